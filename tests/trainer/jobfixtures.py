"""Trainer fixtures: a real sample dataset and small job specs (for tests/trainer and the
torch-xla tier in tests/xla, whose conftests import them)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from hlat_api import Job, load_job

HLAT_DATA = [sys.executable, "-m", "hlat_trainer.data.cli"]


@pytest.fixture(scope="session")
def sample_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`hlat-data sample` output: an Arrow dataset and a BPE tokenizer made from the stdlib."""
    out = tmp_path_factory.mktemp("sample")
    subprocess.run([*HLAT_DATA, "sample", "--out", str(out), "--docs", "400"], check=True,
                   capture_output=True)
    return out


@pytest.fixture(scope="session")
def held_out_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An Arrow file of stdlib pieces the sample dataset does not hold (a held-out set for
    spec.eval): every 97th piece of the library that `sample_data`'s 400 left out."""
    import pyarrow as pa

    from hlat_trainer.data.sample import sample_documents

    trained = set(sample_documents(400))
    held = [d for d in sample_documents(None)[1::97] if d not in trained][:80]
    out = tmp_path_factory.mktemp("held-out") / "held_out.arrow"
    table = pa.table({"text": pa.array(held, type=pa.string())})
    with pa.OSFile(str(out), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return out


def small_spec(data: Path, ckpt: Path, tokenizer: str = "bytes", **over: Any) -> dict[str, Any]:
    """A job small enough to run tens of steps in seconds on 2 cores."""
    spec: dict[str, Any] = {
        "instanceType": "cpu",
        "model": {"preset": "tiny", "hiddenSize": 64, "layers": 2, "intermediateSize": 192,
                  "vocabSize": 512 if tokenizer == "bytes" else 4096, "maxSeqLen": 128},
        "precision": "fp32",
        "optimizer": {"lr": 3e-3, "minLr": 3e-4, "warmupSteps": 2},
        "data": {"path": str(data), "tokenizer": tokenizer, "seqLen": 64},
        "train": {"globalBatch": 4, "microBatch": 2, "steps": 8, "seed": 7},
        "checkpoint": {"dir": str(ckpt), "interval": 3, "keep": 2, "async": False},
    }
    for path, value in over.items():
        node = spec
        *parents, leaf = path.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return spec


@pytest.fixture
def make_job(tmp_path: Path, sample_data: Path) -> Callable[..., Job]:
    def make(name: str = "job", tokenizer: str | None = None, **over: Any) -> Job:
        tok = tokenizer or str(sample_data / "tokenizer.json")
        path = tmp_path / f"{name}.yaml"
        doc = {"kind": "PretrainJob", "metadata": {"name": name},
               "spec": small_spec(sample_data, tmp_path / "ck", tok, **over)}
        path.write_text(yaml.safe_dump(doc))
        return load_job(path)

    return make


@pytest.fixture
def write_config(tmp_path: Path, sample_data: Path) -> Callable[..., Path]:
    def write(name: str = "job", **over: Any) -> Path:
        path = tmp_path / f"{name}.yaml"
        doc = {"kind": "PretrainJob", "metadata": {"name": name},
               "spec": small_spec(sample_data, tmp_path / "ck",
                                  str(sample_data / "tokenizer.json"), **over)}
        path.write_text(yaml.safe_dump(doc))
        return path

    return write
