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
def held_out_data(sample_data: Path) -> Path:
    """The sample's held-out set (spec.eval.path): pieces its training set does not hold."""
    held = sample_data / "held-out"
    assert (held / "held_out.arrow").is_file(), "hlat-data sample --docs N writes one"
    return held


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
