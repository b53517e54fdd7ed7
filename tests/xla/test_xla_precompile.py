"""The precompile run covers every graph a real run meets: its steps, logging, saves, resumes.

`spec.neuron.compileOnly` runs the trainer under `neuron_parallel_compile`, which compiles only
the graphs that run traced. A graph the real run meets later (a save's, a resume's) is compiled
in the middle of training, where on Trainium it takes minutes inside the hang timeout.

Here a "precompile" process runs the trainer's extraction-mode code path
(NEURON_EXTRACT_GRAPHS_ONLY=1) with torch-xla's persistent compile cache on; then real runs in
fresh processes share that cache: one that trains, logs and saves, then one that resumes from
its checkpoint, logs and saves. On PJRT CPU the variable does not make tensors dummies (only
the Neuron runtime reads it): what runs is our trainer's extraction-mode code, with real values.

How coverage is measured. The cache keys executables by graph hash (torch-xla v2.9.0
torch_xla/csrc/runtime/cache.h, PersistentCache::Get l.169-195): a graph whose key is absent
counts `PersistentCacheMiss`; one whose key is present is loaded, counting
`PersistentCacheHit`. PJRT CPU writes executables but cannot read them back ("Deserializing
serialized executable not supported"), so a present key counts
`PersistentCacheDeserializeFailure` instead and compiles again. A real run that meets no graph
the precompile did not trace therefore has no miss, and adds no file (one per graph hash) to
the cache directory. On Neuron the NEFF cache is keyed by the same HLO graphs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.slow

COUNTERS = ("PersistentCacheMiss", "PersistentCacheHit", "PersistentCacheDeserializeFailure")


def drive(config: Path, cache: Path, *sets: str, extract: bool = False,
          snapshots: Path | None = None) -> dict[str, Any]:
    """hlat-train with the xla stand-in backend in a fresh process (`snapshots`: the
    launcher's snapshot directory, HLAT_SNAPSHOT_DIR); its cache counters and the cache's graph
    hashes (file names) once it finished."""
    out = config.parent / "counters.json"
    env = {**os.environ, "PJRT_DEVICE": "CPU"}
    if snapshots is not None:
        env["HLAT_SNAPSHOT_DIR"] = str(snapshots)
    env.pop("NEURON_EXTRACT_GRAPHS_ONLY", None)
    if extract:
        env["NEURON_EXTRACT_GRAPHS_ONLY"] = "1"
    done = subprocess.run(
        [sys.executable, __file__, str(cache), str(out), "--config", str(config),
         *(a for s in sets for a in ("--set", s))],
        env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    counters: dict[str, Any] = json.loads(out.read_text())
    counters["graphs"] = sorted(p.name for p in cache.iterdir())
    counters["stdout"] = done.stdout
    return counters


def test_a_real_run_that_logs_saves_and_resumes_compiles_no_graph_the_precompile_missed(
    write_config: Callable[..., Path], tmp_path: Path,
) -> None:
    """Precompile: 8 steps (the graphs settle after 3; the save and resume traced half-way), none logged or saved before the last (a short run of the
    real spec would be). Real run: 6 steps, logged every 2, saved every 3; then it resumes
    from step_6 and runs to 9 (logged, saved)."""
    config = write_config(train__steps=9, train__logInterval=2, checkpoint__interval=3)
    cache = tmp_path / "xla-cache"
    pre = drive(config, cache, "train.steps=8", extract=True)
    assert pre["PersistentCacheMiss"] > 0  # it compiled (and cached) the graphs it met
    ck = Path(tmp_path / "ck" / "job")
    assert not list(ck.glob("step_*")), "the precompile left a checkpoint a run would load"
    assert not (ck / "_precompile").exists()

    first = drive(config, cache, "train.steps=6")
    resumed = drive(config, cache)
    logged = [json.loads(x)["step"] for x in resumed["stdout"].splitlines() if x[:1] == "{"]
    assert logged == [8, 9]
    for name, run in (("first real run", first), ("resumed run", resumed)):
        new = sorted(set(run["graphs"]) - set(pre["graphs"]))
        assert run["PersistentCacheMiss"] == 0 and not new, (
            f"the {name} compiled {run['PersistentCacheMiss']} graphs the precompile did not "
            f"trace (hashes {new})")
        assert run["PersistentCacheDeserializeFailure"] > 0  # it looked them up, found them
    assert (ck / "step_9" / "done").exists()


def test_a_restore_from_an_in_memory_snapshot_compiles_no_graph_the_precompile_missed(
    write_config: Callable[..., Path], tmp_path: Path,
) -> None:
    """memoryInterval 1 under ZeRO-1 (NxD's engine): the precompile takes no snapshot; the
    real run snapshots every step (host copies: transfers, no graph) up to 5, and the run
    restarted after it resumes from step 5's snapshot, not the durable step_3 (the model's and
    the optimizer's state loaded back, re-sharded), and trains 6 to 9, compiling nothing the
    precompile did not trace: on Trainium a restore from memory must not wait minutes for the
    compiler."""
    config = write_config(train__steps=9, train__logInterval=1, checkpoint__interval=3,
                          checkpoint__memoryInterval=1, parallelism={"zero1": True})
    cache, shm = tmp_path / "xla-cache", tmp_path / "shm"
    pre = drive(config, cache, "train.steps=8", extract=True)
    assert not shm.exists()
    first = drive(config, cache, "train.steps=5", snapshots=shm)
    resumed = drive(config, cache, snapshots=shm)
    logged = [json.loads(x)["step"] for x in resumed["stdout"].splitlines() if x[:1] == "{"]
    assert logged == [6, 7, 8, 9], logged  # from the durable step_3 it would be 4 to 9
    for name, run in (("snapshotting run", first), ("run resumed from memory", resumed)):
        new = sorted(set(run["graphs"]) - set(pre["graphs"]))
        assert run["PersistentCacheMiss"] == 0 and not new, (
            f"the {name} compiled {run['PersistentCacheMiss']} graphs the precompile did not "
            f"trace (hashes {new})")


def test_a_real_run_that_evaluates_compiles_no_graph_the_precompile_missed(
    write_config: Callable[..., Path], held_out_data: Path, tmp_path: Path,
) -> None:
    """spec.eval every 2 steps: the precompile (4 steps of the same spec, evaluating only
    after its last, as a short run of the real spec would) traces the evaluation's graphs, so
    the real run's evaluations after steps 2, 4 and 6 compile nothing; each evaluation reads
    back one value."""
    config = write_config(train__steps=6, checkpoint__interval=3,
                          eval={"path": str(held_out_data), "interval": 2, "batches": 3})
    cache = tmp_path / "xla-cache"
    pre = drive(config, cache, "train.steps=4", "eval.interval=100", extract=True)
    assert pre["PersistentCacheMiss"] > 0
    real = drive(config, cache)
    evaluated = [json.loads(x) for x in real["stdout"].splitlines() if x[:1] == "{"]
    assert [e["step"] for e in evaluated if "validationLoss" in e] == [2, 4, 6], evaluated
    new = sorted(set(real["graphs"]) - set(pre["graphs"]))
    assert real["PersistentCacheMiss"] == 0 and not new, (
        f"the real run compiled {real['PersistentCacheMiss']} graphs the precompile did not "
        f"trace (hashes {new})")


def main(cache: str, out: str, argv: list[str]) -> int:
    """The driven process: the cache before anything compiles, then hlat-train."""
    import torch_xla.debug.metrics as met
    import torch_xla.runtime as xr
    from xla_standin import CpuXlaBackend

    from hlat_trainer.cli import main as hlat_train

    xr.initialize_cache(cache, readonly=False)
    code = hlat_train(argv, backend=CpuXlaBackend)
    Path(out).write_text(json.dumps({c: met.counter_value(c) or 0 for c in COUNTERS}))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], sys.argv[3:]))
