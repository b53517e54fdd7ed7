"""In-place restarts end to end (`faultTolerance.restartStrategy: InPlace`): the pods stay and
their launchers restart the trainers for the new attempt; only pods that are gone are
recreated. Checked at every poll: at most one trainer process per node rank (the launchers'
`hlat-trainer` children) and one gang. The losses of the steps the new attempt trained again
equal the first attempt's bit for bit (the same run, resumed exactly)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from e2e_env import JOB, Env, report_recovery_log
from e2e_spec import tiny_spec

from hlat_testbed import faults
from hlat_testbed.podfiles import PodNotFound

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def in_place_spec(steps: int, **fault_tolerance: object) -> dict[str, object]:
    return tiny_spec(steps=steps, restartStrategy="InPlace", **fault_tolerance)


class TrainerCensus:
    """Samples, every 0.1 s, the trainer processes each worker pod's launcher runs: the most
    ever seen at once for one pod (one pod = one node rank) must be the node's process count."""

    def __init__(self, env: Env) -> None:
        self.env, self.most = env, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for pod in self.env.pods():
                if pod.metadata.deletion_timestamp is not None:
                    continue
                try:
                    pids = faults.trainer_pids(self.env.cluster.config, self.env.ns,
                                               pod.metadata.name)
                except (PodNotFound, OSError, ValueError):
                    continue
                self.most = max(self.most, len(pids))
            self._stop.wait(0.1)

    def __enter__(self) -> TrainerCensus:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)


def losses(log: str) -> dict[int, list[float]]:
    """Every loss each step was logged with, in order (a step trained twice has two)."""
    out: dict[int, list[float]] = {}
    for line in log.splitlines():
        if line.startswith("{") and '"step"' in line:
            row = json.loads(line)
            out.setdefault(int(row["step"]), []).append(float(row["loss"]))
    return out


def run_fault(job_env: Env, inject: Callable[[], object], reason: str,
              steps: int = 40, **ft: object) -> Iterator[dict[str, object]]:
    job_env.create(in_place_spec(steps, **ft))
    with TrainerCensus(job_env) as census:
        job_env.wait("a checkpoint", lambda s: s.get("phase") == "Running"
                     and (s.get("latestCheckpoint") or {}).get("step", 0) >= 2, 180)
        before = {p.metadata.name: p.metadata.uid for p in job_env.pods()}
        fault_at = time.time()
        inject()
        restarting = job_env.wait("the restart", lambda s: s.get("attempt", 0) >= 1, 60)
        assert restarting["lastFailure"]["reason"] == reason, restarting["lastFailure"]
        done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 240)
    yield {"done": done, "before": before, "fault_at": fault_at, "census": census}


def check_in_place(job_env: Env, r: dict[str, object], kept: int) -> None:
    done, before = r["done"], r["before"]
    assert isinstance(done, dict) and isinstance(before, dict)
    assert done["restarts"] == {"total": 1, "counted": 1, "inPlace": 1}, done["restarts"]
    assert done["attempt"] == 1
    after = {p.metadata.name: p.metadata.uid for p in job_env.pods()}
    assert len(set(before.items()) & set(after.items())) == kept, (before, after)
    census = r["census"]
    assert isinstance(census, TrainerCensus)
    assert census.most == 1, "two trainers of one node rank ran at once"
    assert job_env.max_gangs == 1
    log = job_env.cluster.pod_log(job_env.ns, f"{JOB}-a0-0")
    seen = losses(log)
    assert max(seen) == 40
    again = {step: ls for step, ls in seen.items() if len(ls) > 1}
    for step, ls in again.items():  # trained again after the resume: the same numbers
        assert ls[0] == ls[-1], (step, ls)
    assert {"Created", "Completed"} <= set(job_env.events())


def test_a_killed_trainer_restarts_in_place(job_env: Env) -> None:
    victim = f"{JOB}-a0-1"
    r = next(run_fault(job_env, lambda: faults.kill_trainer(
        job_env.cluster.config, job_env.ns, victim), "Killed"))
    check_in_place(job_env, r, kept=2)
    report_recovery_log(job_env, "trainer SIGKILLed, in place",
                        job_env.cluster.pod_log(job_env.ns, f"{JOB}-a0-0"), 1,
                        float(r["fault_at"]))  # type: ignore[arg-type]
