"""Soaks: one job through 30+ faults of random kinds (seeded), on the local cluster, once per
restart strategy.

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
Under InPlace the kinds are the in-place ones (a trainer SIGKILLed or frozen, its launcher and
pod kept; a worker pod deleted; a launcher SIGKILLed, which ends the container; the operator
SIGKILLed) and never two trainers of one node rank or two live pods of one rank at once.
"""

from __future__ import annotations

import json
import random
import re
import signal
import time
from collections import Counter
from typing import Any

import pytest
from e2e_env import JOB, Env, TrainerCensus, resumed_from
from e2e_env import losses as all_losses
from e2e_spec import tiny_spec

from hlat_testbed import faults
from hlat_testbed.demo import OperatorProcess

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

SEED = 20261124
FAULTS = 32
STEPS = 900
KINDS = {"kill": 5, "term": 2, "delete": 3, "hang": 0.6, "operator": 2.5}
WORKER_FAULTS = {"kill", "term", "delete", "hang"}


def _spec(strategy: str = "RecreateGang") -> dict[str, Any]:
    spec: dict[str, Any] = tiny_spec(steps=STEPS, maxRestarts=FAULTS + 5,
                     restartStrategy=strategy,
                     backoff={"initialSeconds": 0.5, "maxSeconds": 1},
                     heartbeat={"startupTimeoutSeconds": 120, "timeoutSeconds": 5})
    spec["checkpoint"].update({"interval": 10, "keep": 2})
    return spec


def _losses(log: str) -> dict[int, float]:
    out = {}
    for line in log.splitlines():
        if line.startswith("{") and '"loss"' in line:
            entry = json.loads(line)
            out[int(entry["step"])] = float(entry["loss"])
    return out


def _all_attempt_losses(env: Env, attempts: int) -> list[dict[int, float]]:
    return [_losses(env.pod_log(a, 0)) for a in range(attempts)]


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
        job_env: Env) -> None:
    # the uninterrupted run first, same spec, under another name
    reference = job_env.other("reference")
    reference.create(_spec())
    reference.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 300)
    expected = _losses(reference.pod_log(0, 0))
    assert sorted(expected) == list(range(1, STEPS + 1))
    reference.delete()

    rng = random.Random(SEED)
    kinds = rng.choices(list(KINDS), weights=list(KINDS.values()), k=FAULTS)
    job_env.create(_spec())
    attempt, last_checkpoint, injected = 0, -1, Counter[str]()
    for n, kind in enumerate(kinds):
        status = job_env.wait(
            f"attempt {attempt} running past checkpoint {last_checkpoint} (fault {n})",
            lambda s: s.get("phase") == "Running" and s.get("attempt") == attempt  # noqa: B023
            and (s.get("latestCheckpoint") or {}).get("step", -1) > last_checkpoint,  # noqa: B023
            240)
        if status["progress"]["step"] >= STEPS - 20:
            break  # the run ends before the faults do: fewer than planned (checked below)
        last_checkpoint = status["latestCheckpoint"]["step"]
        _inject(job_env, kind, attempt, rng)
        injected[kind] += 1
        if kind in WORKER_FAULTS:
            attempt += 1
        else:
            time.sleep(1)
    done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 300)
    print(f"faults injected: {dict(injected)}; transitions: {len(job_env.transitions)}")
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


IN_PLACE_KINDS = {"kill": 5, "hang": 1, "delete": 2, "launcher": 2, "operator": 2}
IN_PLACE_WORKER_FAULTS = {"kill", "hang", "delete", "launcher"}


def _pod_of_rank(env: Env, rank: int) -> str:
    """The live pod that holds node rank `rank` now (an in-place restart keeps pod names)."""
    for pod in env.pods():
        labels = pod.metadata.labels or {}
        if (labels.get("hlat.dev/node-rank") == str(rank)
                and pod.metadata.deletion_timestamp is None):
            return str(pod.metadata.name)
    raise AssertionError(f"no live pod holds rank {rank}")


def _inject_in_place(env: Env, kind: str, rng: random.Random) -> None:
    config = env.cluster.config
    if kind == "operator":
        _restart_operator(env)
        return
    pod = _pod_of_rank(env, rng.randrange(2))
    if kind == "kill":
        faults.kill_trainer(config, env.ns, pod)
    elif kind == "hang":
        faults.hang_trainer(config, env.ns, pod)
    elif kind == "delete":
        env.core.delete_namespaced_pod(pod, env.ns)
    else:  # the launcher, the container's main process: the pod fails and is replaced
        faults.kill(config, env.ns, pod)


def test_thirty_random_faults_restarted_in_place_end_with_an_uninterrupted_run_s_losses(
        job_env: Env) -> None:
    reference = job_env.other("reference")
    reference.create(_spec())
    reference.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 300)
    expected = _losses(reference.pod_log(0, 0))
    assert sorted(expected) == list(range(1, STEPS + 1))
    reference.delete()

    rng = random.Random(SEED)
    kinds = rng.choices(list(IN_PLACE_KINDS), weights=list(IN_PLACE_KINDS.values()), k=FAULTS)
    job_env.create(_spec("InPlace"))
    attempt, last_checkpoint, injected = 0, -1, Counter[str]()
    with TrainerCensus(job_env) as census:
        for n, kind in enumerate(kinds):
            # the attempt running, then a checkpoint of its own: its trainers exist and trained
            # (the previous attempt may have committed one more before it was stopped)
            status = job_env.wait(
                f"attempt {attempt} running (fault {n})",
                lambda s: s.get("phase") == "Running" and s.get("attempt") == attempt,  # noqa: B023
                240)
            base = max(last_checkpoint, (status.get("latestCheckpoint") or {}).get("step", -1))
            status = job_env.wait(
                f"attempt {attempt} past checkpoint {base} (fault {n})",
                lambda s: s.get("attempt") == attempt  # noqa: B023
                and (s.get("latestCheckpoint") or {}).get("step", -1) > base,  # noqa: B023
                240)
            if status["progress"]["step"] >= STEPS - 20:
                break
            last_checkpoint = status["latestCheckpoint"]["step"]
            _inject_in_place(job_env, kind, rng)
            injected[kind] += 1
            if kind in IN_PLACE_WORKER_FAULTS:
                attempt += 1
            else:
                time.sleep(1)
        done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 300)
    print(f"faults injected: {dict(injected)}; pods: {len(census.names)}")
    assert sum(injected.values()) >= 30, injected

    worker_faults = sum(injected[k] for k in IN_PLACE_WORKER_FAULTS)
    assert done["restarts"]["total"] == worker_faults, (done["restarts"], injected)
    assert done["restarts"]["inPlace"] == worker_faults, (done["restarts"], injected)
    assert done["attempt"] == worker_faults and done["progress"]["step"] == STEPS
    in_place = [m for _, m in job_env.event_messages() if "restarting in place" in m]
    assert len(in_place) == worker_faults, in_place
    assert census.most == 1, "two trainers of one node rank ran in one pod at once"
    assert census.most_pods == 1, "two live pods of one node rank"
    # one pod per deleted pod or failed launcher, not one gang per fault
    replaced = injected["delete"] + injected["launcher"]
    assert len(census.names) == 2 + replaced, (sorted(census.names), injected)

    # every loss any attempt logged is the uninterrupted run's at that step, bit for bit
    logs = [job_env.cluster.pod_log(job_env.ns, name)
            for name in sorted(census.names) if name.endswith("-0")]
    seen: dict[int, list[float]] = {}
    for log in logs:
        for step, values in all_losses(log).items():
            seen.setdefault(step, []).extend(values)
    differing = {step: (values, expected[step]) for step, values in seen.items()
                 if any(v != expected[step] for v in values)}
    assert not differing, f"losses differ from the uninterrupted run: " \
                          f"{dict(list(differing.items())[:5])}"
    resumed = {int(m) for log in logs
               for m in re.findall(r"resumed from checkpoint step_(\d+)", log)}
    unlogged = set(range(1, STEPS + 1)) - set(seen)
    assert unlogged <= resumed, f"steps never trained: {sorted(unlogged - resumed)}"
    recomputed = sum(len(v) for v in seen.values()) - len(seen)
    print(f"steps recomputed over the run: {recomputed}")
