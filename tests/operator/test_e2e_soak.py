"""A soak: one job through 30+ faults of random kinds (seeded), on the local cluster (the
gang recreated at each; the InPlace soak: test_e2e_soak_inplace.py).

The kinds: a worker SIGKILLed, a worker SIGTERMed, a worker pod deleted, a worker frozen
(SIGSTOP: a hang), the operator SIGKILLed and started again. Each fault comes once the job has
made progress since the last one (the operator saw a newer complete checkpoint), as faults do
on a long run. What must hold at the end:
- the job Succeeded, all its steps trained;
- restarts counted exactly: one per worker fault, none for the operator's own death, and one
  "restarting the gang" Event each;
- the losses are an uninterrupted run's: every step any attempt trained (recomputed ones
  included) has the loss a run of the same spec without faults had at that step, bit for bit;
- never two gangs at once.
"""

from __future__ import annotations

import fcntl
import json
import random
import signal
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import IO, Any

import pytest
from e2e_env import JOB, Env, metric_lines, resumed_from
from e2e_spec import tiny_spec

from hlat_testbed import faults
from hlat_testbed.demo import OperatorProcess
from hlat_testbed.testing import wait_for

SOAK_SECONDS = 2400
"""pytest's bound on each soak (the suite's is 900 s). 2000 steps, measured 2026-11-28: the two
soaks side by side on 2 cores, nothing else running, 1161 s and 852 s (the CPUs busy all the
while: vmstat showed no idle time until the in-place soak ended); in a full `make test`, 1358 s
and 805 s. The gang-recreating soak is the longer by the shared reference run it trains first."""
pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(SOAK_SECONDS)]

SEED = 20261124
FAULTS = 32
STEPS = 2000
"""Room for the faults: each costs the steps trained between an attempt's first step and the
test seeing it Ready (the heartbeat period, an operator pass and a status write, slower with
both soaks' trainers and operators on 2 cores), less what the restart rolled back; an operator
fault costs the steps trained while the operator restarts. Measured with the two soaks alone
side by side (2026-11-27): 32 faults in place by step 1400; recreating the gang 29 by step
1430, 50 a fault, 100 after an operator restart. 900 steps ran out at 26 faults in CI, 1200 and
1500 at 26 and 29 (RecreateGang)."""
REFERENCE_SECONDS = 1000
"""Bound on the uninterrupted reference run: with the other soak beside it on 2 cores it trains
about 3 steps/s (one CI run reached step 886 of 900 at 300 s, a bound before), alone about 10."""


def fault_due(n: int, faults: int = FAULTS) -> int:
    """The step the n-th of `faults` waits for: the faults spread evenly over the run, whatever
    its speed (waiting for a checkpoint past the last fault's, as before, cost a checkpoint
    interval more per fault). A fault due at a step the run already passed comes once the
    attempt trains (Ready)."""
    return n * (STEPS - 60) // faults


KINDS = {"kill": 5, "term": 2, "delete": 3, "hang": 0.6, "operator": 2.5}
WORKER_FAULTS = {"kill", "term", "delete", "hang"}


def _spec(strategy: str = "RecreateGang") -> dict[str, Any]:
    spec: dict[str, Any] = tiny_spec(steps=STEPS, maxRestarts=FAULTS + 5,
                     restartStrategy=strategy,
                     backoff={"initialSeconds": 0.5, "maxSeconds": 1},
                     heartbeat={"startupTimeoutSeconds": 120, "timeoutSeconds": 5})
    spec["checkpoint"].update({"interval": 10, "keep": 2})
    return spec


def _ready(status: dict[str, Any]) -> bool:
    """The attempt's every worker reported training (the operator's Ready condition)."""
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in status.get("conditions") or [])


def _due(status: dict[str, Any], attempt: int, n: int, faults: int = FAULTS) -> bool:
    """Fault `n` of `faults` may come: the attempt trains (Ready) at or past the fault's step;
    or the run ended first (Succeeded: the loop stops, the count of faults is checked after)."""
    return status.get("phase") == "Succeeded" or (
        status.get("phase") == "Running" and status.get("attempt") == attempt and _ready(status)
        and (status.get("progress") or {}).get("step", -1) >= fault_due(n, faults))


def _losses(log: str) -> dict[int, float]:
    return {int(row["step"]): float(row["loss"]) for row in metric_lines(log)}


def _all_attempt_losses(env: Env, attempts: int) -> list[dict[int, float]]:
    return [_losses(env.pod_log(a, 0)) for a in range(attempts)]


def _locked(held: IO[str]) -> bool:
    """Took the exclusive lock on the open file `held` (False: another process holds it)."""
    try:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def reference_losses(env: Env, testrun_uid: str) -> dict[int, float]:
    """Every step's loss of an uninterrupted run of `_spec()` on the cluster (saving only at
    its end), trained once per
    test run and shared by both soaks (the restart strategy does not change what is trained;
    each soak used to train its own, about a tenth of the suite's CPU time). The first soak to
    ask trains it on its own cluster, holding a lock the other waits on (bounded); the file is
    keyed by pytest-xdist's run id, so no run reads another's."""
    shared = Path(tempfile.gettempdir()) / f"hlat-soak-reference-{testrun_uid}"
    lock = shared.with_suffix(".lock")
    with lock.open("w") as held:
        wait_for(lambda: _locked(held), REFERENCE_SECONDS + 120,
                 "the other soak's reference run to end", interval=2)
        if shared.exists():
            return {int(step): loss for step, loss in json.loads(shared.read_text()).items()}
        reference = env.other("reference")
        # checkpoints only at the end: a run with no fault resumes from none, and what is
        # trained does not depend on when it saves (the soaks' own runs save every 10 steps,
        # which also shows it); saving every 10 steps took 3.1 s of a 16.7 s loop of 300
        # steps (this spec, one local process, cProfile, 2026-11-28)
        spec = _spec()
        spec["checkpoint"]["interval"] = STEPS
        reference.create(spec)
        reference.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", REFERENCE_SECONDS)
        expected = _losses(reference.pod_log(0, 0))
        assert sorted(expected) == list(range(1, STEPS + 1))
        # no assertion on Straggler flags here or in the soaks: their nodes are processes
        # sharing two cores with the rest of the suite, and one of them really is slower for
        # tens of seconds at a time (CI, 2026-11-30: 1.46-1.85x over 30 s of a healthy
        # reference run); a flag would assert the CPU scheduler's fairness. A healthy gang's
        # window with no flag is checked where the load is ours (test_e2e_stragglers, run
        # alone), and measured as precision by bench_stragglers, with a healthy gang watched
        # for longer than a soak (930 s, no flag: docs/benchmarks.md); action Report, the default,
        # changes nothing trained, which the losses and restart counts below check.
        reference.delete()
        shared.write_text(json.dumps(expected))
        return expected


def _restart_operator(env: Env) -> None:
    old = env.operator["op"]
    old.kill()
    env.operator["op"] = OperatorProcess(env.cluster, old.log_path, old.namespaces,
                                         old.extra_env, old.kubeconfig).start()


def _inject(env: Env, kind: str, attempt: int, rng: random.Random) -> None:
    pod = f"{JOB}-a{attempt}-{rng.randrange(2)}"
    config = env.cluster.config
    if kind == "kill":
        faults.kill(config, env.ns, pod)
    elif kind == "term":
        faults.kill(config, env.ns, pod, signal.SIGTERM)
    elif kind == "delete":
        env.core.delete_namespaced_pod(pod, env.ns)
    elif kind == "hang":
        faults.hang(config, env.ns, pod)
    else:
        _restart_operator(env)


def test_thirty_random_faults_end_succeeded_with_an_uninterrupted_run_s_losses(
        job_env: Env, testrun_uid: str) -> None:
    # the uninterrupted run first (the in-place soak, beside this one, asks for it last)
    expected = reference_losses(job_env, testrun_uid)

    rng = random.Random(SEED)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=FAULTS)
    job_env.create(_spec())
    attempt, at, injected = 0, list[int](), Counter[str]()
    for n, kind in enumerate(kinds):
        status = job_env.wait(
            f"attempt {attempt} training at step {fault_due(n)} (fault {n})",
            lambda s: _due(s, attempt, n), 240)  # noqa: B023
        if status.get("phase") == "Succeeded" or status["progress"]["step"] >= STEPS - 20:
            break  # the run ends before the faults do: fewer than planned (checked below)
        at.append(status["progress"]["step"])
        _inject(job_env, kind, attempt, rng)
        injected[kind] += 1
        if kind in WORKER_FAULTS:
            attempt += 1
        else:
            time.sleep(1)
    done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 300)
    print(f"faults injected: {dict(injected)} at steps {at}; "
          f"transitions: {len(job_env.transitions)}")
    assert sum(injected.values()) >= 30, injected

    worker_faults = sum(injected[k] for k in WORKER_FAULTS)
    assert done["restarts"]["total"] == worker_faults, (done["restarts"], injected)
    assert done["attempt"] == worker_faults
    restarts = [m for _, m in job_env.event_messages() if "restarting the gang" in m]
    assert len(restarts) == worker_faults, restarts
    assert done["progress"]["step"] == STEPS and job_env.max_gangs == 1

    trained = _all_attempt_losses(job_env, worker_faults + 1)
    # a step no attempt logged: only one whose checkpoint was saved and the worker killed
    # before it printed that step's line (the save comes first); the next attempt resumed
    # from exactly that checkpoint
    resumed = {resumed_from(job_env.pod_log(a, 0)) for a in range(1, worker_faults + 1)}
    unlogged = set(range(1, STEPS + 1)) - set().union(*trained)
    assert unlogged <= resumed, f"steps never trained: {sorted(unlogged - resumed)}"
    for number, losses in enumerate(trained):
        differing = {s: (loss, expected[s]) for s, loss in losses.items() if loss != expected[s]}
        assert not differing, f"attempt {number}: losses differ from the uninterrupted run: " \
                              f"{dict(list(differing.items())[:5])}"
    recomputed = sum(len(losses) for losses in trained) - STEPS + len(unlogged)
    print(f"steps recomputed over the run: {recomputed}")
