"""`hlat-export`: a durable checkpoint as a Hugging Face Llama directory that `transformers`
(and so lm-evaluation-harness's `hf` model) loads as it is, computing our model's logits, with
the run's tokenizer."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from hlat_api import ExitCode, Job
from hlat_trainer import evaluate, export
from hlat_trainer.data import load_tokenizer
from hlat_trainer.train import Trainer


def test_an_exported_checkpoint_loads_in_transformers_and_computes_our_logits(
        make_job: Callable[..., Job], tmp_path: Path) -> None:
    # grouped-query attention (2 query heads a key-value head): the layout the export splits
    job = make_job(train__steps=4, checkpoint__interval=2, model={
        "preset": "tiny", "hiddenSize": 64, "layers": 2, "heads": 4, "kvHeads": 2,
        "intermediateSize": 96, "vocabSize": 4096, "maxSeqLen": 128})
    Trainer(job).run()
    out = tmp_path / "hf"
    assert export.main(["--config", str(tmp_path / "job.yaml"), "--step", "2",
                        "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    hf = LlamaForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    entry = evaluate.choose(job.spec.checkpoint.dir, job.name, 2)
    engine, _ = evaluate.load(job.spec, job.name, entry, held_out=False)
    ours = engine.model.eval()
    # the run's tokenizer, as the harness loads it: the same ids, no special tokens added
    theirs = AutoTokenizer.from_pretrained(out)
    text = "def packed(docs):\n    return [t for d in docs for t in d]\n"
    ids = load_tokenizer(job.spec.data.tokenizer).encode_batch([text])[0]
    assert theirs(text, add_special_tokens=False)["input_ids"] == ids
    assert theirs.eos_token == "<|endoftext|>" and config["eos_token_id"] == theirs.eos_token_id
    tokens = torch.tensor([ids[:48]])
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), atol=2e-5, rtol=1e-4)


def test_a_run_without_a_tokenizer_file_is_refused_naming_it(
        make_job: Callable[..., Job], tmp_path: Path, capsys: pytest.CaptureFixture[str]
        ) -> None:
    job = make_job(tokenizer="bytes", train__steps=2, checkpoint__interval=2)
    Trainer(job).run()
    code = export.main(["--config", str(tmp_path / "job.yaml"), "--out", str(tmp_path / "x")])
    assert code == ExitCode.CONFIG_ERROR
    assert "data.tokenizer is `bytes`" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
