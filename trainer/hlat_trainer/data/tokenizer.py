"""Tokenizers the data loader can use: a HF `tokenizers` JSON file, or built-in bytes.

Why this module exists: the loader tokenizes online (paper section 3.3), so it needs a tokenizer
object with a batch encoder and a known end-of-sequence id, and the trainer needs the vocab size
to check it against the model's. Both kinds below satisfy the small `Tokenizer` protocol.

Design choices and trade-offs:
- `load_tokenizer("bytes")` is a built-in byte-level tokenizer (ids 0-255 are the UTF-8 bytes,
  256 is EOS, vocab 257). It needs no file, never fails, and decodes losslessly, which is what
  tests want; it is 3-4x less compact than a trained BPE, so it is not for real training.
- Any other spec is a path to a HF `tokenizers` JSON file. Its EOS id comes from a *special*
  token in the file: the first of `EOS_CANDIDATES` that exists, else the only special token.
  We never guess among several unknown special tokens; the user gets an error naming them.
- Padding and truncation settings in the file are switched off: a packed document is never cut
  or padded.
- Encoding adds no special tokens (no BOS): the loader appends EOS after every document itself,
  so the packed stream is `doc EOS doc EOS ...` whatever the tokenizer's post-processor says.
- `fingerprint` identifies the vocabulary (a hash of the JSON file), so a loader state saved
  with one tokenizer is refused by a loader built with another.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Protocol, runtime_checkable

from tokenizers import Tokenizer as _HFTokenizer

from hlat_trainer.errors import UserError

BYTES_SPEC = "bytes"
"""The `data.tokenizer` value that selects the built-in byte-level tokenizer."""

EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eos|>", "[EOS]")
"""Special tokens recognised as end-of-sequence, in order of preference."""


@runtime_checkable
class Tokenizer(Protocol):
    """What the loader and the trainer need from a tokenizer."""

    vocab_size: int
    eos_id: int
    fingerprint: str

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text, without any special tokens."""
        ...

    def decode(self, ids: list[int]) -> str:
        """Text of `ids` (special tokens included as text)."""
        ...


class ByteTokenizer:
    """UTF-8 bytes as tokens (0-255) plus EOS (256): for tests and smoke runs."""

    vocab_size: int = 257
    eos_id: int = 256
    fingerprint: str = "bytes-v1"

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        out = bytearray()
        for i in ids:
            out.extend(b"<|endoftext|>" if i == self.eos_id else bytes((i,)))
        return out.decode("utf-8", errors="replace")


class HFTokenizer:
    """A HF `tokenizers` JSON tokenizer with an EOS special token."""

    def __init__(self, path: Path, eos_token: str | None = None) -> None:
        self.path = path
        raw = _read_tokenizer_file(path)
        self._tok = _take_parsed(path, raw) or _parse_tokenizer(path, raw)
        # files from model hubs may enable these; either would corrupt packed documents
        self._tok.no_padding()
        self._tok.no_truncation()
        self.vocab_size = int(self._tok.get_vocab_size(with_added_tokens=True))
        self.eos_token = _pick_eos(path, self._special_tokens(), eos_token)
        eos_id = self._tok.token_to_id(self.eos_token)
        assert eos_id is not None  # _pick_eos only returns tokens of this vocab
        self.eos_id = int(eos_id)
        self.fingerprint = "hf-" + hashlib.sha256(raw).hexdigest()[:16]

    def _special_tokens(self) -> list[str]:
        decoder = self._tok.get_added_tokens_decoder()
        return [decoder[i].content for i in sorted(decoder) if decoder[i].special]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        encodings = self._tok.encode_batch(texts, add_special_tokens=False)
        return [e.ids for e in encodings]

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=False))


def load_tokenizer(spec: str, eos_token: str | None = None) -> Tokenizer:
    """The tokenizer that `data.tokenizer` names: "bytes" or a path to a tokenizer JSON file.

    `eos_token` overrides which special token ends a document (HF files only).
    """
    if spec == BYTES_SPEC:
        return ByteTokenizer()
    return HFTokenizer(Path(spec), eos_token)


_parsed_ahead: dict[Path, tuple[bytes, _HFTokenizer]] = {}


def parse_ahead(spec: str) -> None:
    """Parse the tokenizer file that `data.tokenizer` names now, for the next `load_tokenizer`
    of it in this process to take (a warm standby trainer does this before its attempt: a large
    vocabulary takes a fraction of a second to parse). Used once: never shared by two loaders.
    The file is read again then, and a file changed meanwhile is parsed again."""
    if spec == BYTES_SPEC:
        return
    path = Path(spec)
    raw = _read_tokenizer_file(path)
    _parsed_ahead[path] = (raw, _parse_tokenizer(path, raw))


def _take_parsed(path: Path, raw: bytes) -> _HFTokenizer | None:
    ahead = _parsed_ahead.pop(path, None)
    return ahead[1] if ahead is not None and ahead[0] == raw else None


def _read_tokenizer_file(path: Path) -> bytes:
    if not path.is_file():
        raise UserError(
            f"tokenizer file {path} does not exist: set data.tokenizer to a HF tokenizers JSON "
            f'file (e.g. the tokenizer.json that `hlat-data sample --out DIR` writes) or to "bytes"'
        )
    return path.read_bytes()


def _parse_tokenizer(path: Path, raw: bytes) -> _HFTokenizer:
    try:
        json.loads(raw)
        return _HFTokenizer.from_str(raw.decode("utf-8"))
    except Exception as exc:  # JSON, UTF-8 or tokenizers errors: all mean "not a tokenizer"
        raise UserError(
            f"{path} is not a valid HF tokenizers JSON file ({type(exc).__name__}: "
            f"{str(exc)[:200]}): set data.tokenizer to a file saved by `tokenizers` "
            f'(Tokenizer.save) or to "bytes"'
        ) from exc


def _pick_eos(path: Path, specials: list[str], wanted: str | None) -> str:
    if wanted is not None:
        if wanted not in specials:
            raise UserError(
                f"EOS token {wanted!r} is not a special token of {path} "
                f"(special tokens: {specials or 'none'}): pick one of them"
            )
        return wanted
    for name in EOS_CANDIDATES:
        if name in specials:
            return name
    if len(specials) == 1:
        return specials[0]
    if not specials:
        raise UserError(
            f"tokenizer {path} has no special tokens, so it has no end-of-sequence token to put "
            f'between documents: retrain it with a special token such as "<|endoftext|>" '
            f"(`hlat-data sample` does)"
        )
    raise UserError(
        f"tokenizer {path} has several special tokens {specials} and none of the known EOS "
        f"names {list(EOS_CANDIDATES)}: add one of those names as a special token"
    )
