"""`hlat-train` turns every bad input into a message naming the field or file, and exit code 2
(the operator treats it as permanent); nothing half-written is ever loaded."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from hlat_api import ExitCode

TRAIN = [sys.executable, "-m", "hlat_trainer"]


def train(config: Path, *sets: str) -> subprocess.CompletedProcess[str]:
    args = [*TRAIN, "--config", str(config)]
    for s in sets:
        args += ["--set", s]
    return subprocess.run(args, capture_output=True, text=True, timeout=300)


def write_arrow(path: Path, table: pa.Table) -> Path:
    with ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)
    return path


def test_json_lines_on_stdout_with_the_documented_keys(write_config: Callable[..., Path]) -> None:
    done = train(write_config(), "train.steps=2")
    assert done.returncode == 0, done.stderr
    import json

    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("loss", "lr", "gradNorm", "tokensPerSecond", "paramNorm", "mfu"):
        assert all(key in r for r in rows), key


def bad_inputs(tmp_path: Path) -> list[tuple[list[str], str]]:
    notes = tmp_path / "notes.arrow"
    notes.write_text("this is not arrow")
    empty = write_arrow(tmp_path / "empty.arrow", pa.table({"text": pa.array([], pa.string())}))
    wrong = write_arrow(tmp_path / "wrong.arrow", pa.table({"body": ["a document"]}))
    (tmp_path / "nothing").mkdir()
    return [
        ([f"data.path={tmp_path / 'missing'}"], str(tmp_path / "missing")),
        ([f"data.path={tmp_path / 'nothing'}"], "hlat-data sample"),
        ([f"data.path={notes}"], "notes.arrow"),
        ([f"data.path={empty}"], "no documents"),
        ([f"data.path={wrong}"], "textColumn"),
        ([f"data.tokenizer={tmp_path / 'tok.json'}"], "tok.json"),
        (["model.vocabSize=300"], "model.vocabSize"),
        (["train.steps=-1"], "spec.train.steps"),
        (["train.globalBatch=3"], "spec.train.globalBatch"),
        (["precision=fp8"], "spec.precision"),
        (["train.stpes=4"], "unknown key 'stpes'"),
        (["nodes=2"], "single process"),
        # the NxD path is selected and driven, but its packages are not on this machine
        (["backend=neuron-xla", "instanceType=trn1.2xlarge", "processesPerNode=1"],
         "backend neuron-xla needs the `torch-xla (Neuron build)`"),
        # a backend the instance type cannot run, named before anything starts
        (["backend=neuron-xla"], "spec.backend: neuron-xla cannot run on cpu"),
    ]


@pytest.mark.slow
def test_bad_inputs_name_the_field_or_file(
    write_config: Callable[..., Path], tmp_path: Path
) -> None:
    config = write_config()
    for sets, expected in bad_inputs(tmp_path):
        done = train(config, *sets)
        assert done.returncode == ExitCode.CONFIG_ERROR, (sets, done.stderr[-2000:])
        assert expected in done.stderr, (sets, done.stderr[-2000:])
        assert "Traceback" not in done.stderr, sets
        assert not (tmp_path / "ck" / "job").exists() or not any(
            (tmp_path / "ck" / "job").iterdir()
        ), "a failed start writes no checkpoint"
