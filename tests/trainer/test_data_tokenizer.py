"""Tokenizers: the built-in byte-level one and HF `tokenizers` JSON files, with their errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hlat_trainer.data import ByteTokenizer, HFTokenizer, load_tokenizer
from hlat_trainer.errors import UserError

CORPUS = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n", "héllo wörld ✓"] * 20


def train_bpe(path: Path, specials: list[str], vocab: int = 300) -> Path:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    tok.save(str(path))
    return path


def test_bytes_tokenizer_round_trips_utf8_and_has_eos_outside_bytes() -> None:
    tok = load_tokenizer("bytes")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    [ids] = tok.encode_batch(["héllo ✓"])
    assert ids == list("héllo ✓".encode())
    assert all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == "héllo ✓"
    assert tok.decode([*ids, tok.eos_id]) == "héllo ✓<|endoftext|>"


def test_hf_tokenizer_takes_eos_from_its_special_token(tmp_path: Path) -> None:
    path = train_bpe(tmp_path / "tok.json", ["<pad>", "<|endoftext|>"])
    tok = load_tokenizer(str(path))
    assert isinstance(tok, HFTokenizer)
    assert tok.eos_id == 1  # specials come first, in order
    assert tok.vocab_size == Tokenizer.from_file(str(path)).get_vocab_size() > 258
    texts = ["def f(x):\n    return x + 1\n", "héllo wörld ✓"]
    encoded = tok.encode_batch(texts)
    assert [tok.decode(ids) for ids in encoded] == texts
    assert all(tok.eos_id not in ids for ids in encoded)  # no special tokens added
    assert len(encoded[0]) < len(texts[0].encode())  # it really merges


def test_padding_and_truncation_in_the_file_are_ignored(tmp_path: Path) -> None:
    path = train_bpe(tmp_path / "t.json", ["<|endoftext|>"])
    hub_style = Tokenizer.from_file(str(path))
    hub_style.enable_truncation(max_length=4)
    hub_style.enable_padding(pad_id=0, pad_token="<|endoftext|>")
    hub_style.save(str(path))
    tok = load_tokenizer(str(path))
    texts = ["a", "def f(x):\n    return x + 1\n" * 3]
    assert [tok.decode(ids) for ids in tok.encode_batch(texts)] == texts


def test_single_unknown_special_token_is_the_eos(tmp_path: Path) -> None:
    tok = load_tokenizer(str(train_bpe(tmp_path / "t.json", ["<END>"])))
    assert tok.decode([tok.eos_id]) == "<END>"


def test_eos_token_can_be_named(tmp_path: Path) -> None:
    path = train_bpe(tmp_path / "t.json", ["<a>", "<b>"])
    assert load_tokenizer(str(path), eos_token="<b>").eos_id == 1
    with pytest.raises(UserError, match=r"'<c>' is not a special token .*t\.json"):
        load_tokenizer(str(path), eos_token="<c>")


def test_fingerprint_tells_tokenizers_apart(tmp_path: Path) -> None:
    a = load_tokenizer(str(train_bpe(tmp_path / "a.json", ["<|endoftext|>"], vocab=270)))
    b = load_tokenizer(str(train_bpe(tmp_path / "b.json", ["<|endoftext|>"], vocab=280)))
    assert a.fingerprint != b.fingerprint != load_tokenizer("bytes").fingerprint


def test_missing_tokenizer_file(tmp_path: Path) -> None:
    with pytest.raises(
        UserError, match=r"tokenizer file .*nope\.json does not exist.*data\.tokenizer"
    ):
        load_tokenizer(str(tmp_path / "nope.json"))


@pytest.mark.parametrize("content", [b"not json", b'{"version": "1.0"}', b"\xff\xfe"])
def test_invalid_tokenizer_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(UserError, match=r"bad\.json is not a valid HF tokenizers JSON file"):
        load_tokenizer(str(path))


def test_tokenizer_without_special_tokens_is_refused(tmp_path: Path) -> None:
    path = train_bpe(tmp_path / "nospecial.json", [])
    with pytest.raises(UserError, match=r"nospecial\.json has no special tokens.*<\|endoftext\|>"):
        load_tokenizer(str(path))


def test_ambiguous_special_tokens_are_refused(tmp_path: Path) -> None:
    path = train_bpe(tmp_path / "two.json", ["<x>", "<y>"])
    with pytest.raises(UserError, match=r"two\.json has several special tokens \['<x>', '<y>'\]"):
        load_tokenizer(str(path))


def test_a_tokenizer_parsed_ahead_is_taken_once_and_never_when_the_file_changed(
        tmp_path: Path) -> None:
    """What a warm standby trainer does before its attempt: the parse it did is the one the
    attempt's loader gets, used once (two loaders never share one), and a file that changed
    in between is parsed again (the attempt sees the file as it is)."""
    from hlat_trainer.data import tokenizer as module

    path = train_bpe(tmp_path / "tok.json", ["<|endoftext|>"])
    module.parse_ahead(str(path))
    ahead = module._parsed_ahead[path][1]
    first, second = load_tokenizer(str(path)), load_tokenizer(str(path))
    assert isinstance(first, HFTokenizer) and isinstance(second, HFTokenizer)
    assert first._tok is ahead and second._tok is not ahead
    assert first.encode_batch(CORPUS[:2]) == second.encode_batch(CORPUS[:2])

    module.parse_ahead(str(path))
    stale = module._parsed_ahead[path][1]
    train_bpe(path, ["<|endoftext|>"], vocab=280)  # the file changes before the attempt
    changed = load_tokenizer(str(path))
    assert isinstance(changed, HFTokenizer)
    assert changed._tok is not stale
    assert changed.vocab_size == 280 and not module._parsed_ahead
