"""Goodput as a new user checks it (issue 34): the tiny example as shipped (the product's
default InPlace restarts, the operator's default intervals), 200 steps with asynchronous saves,
one worker's container SIGKILLed as soon as the status shows the checkpoint of step 20, at no
chosen moment of the training loop (test_e2e_goodput times its kills after a fresh heartbeat;
this one may land with a step in flight, mid-save, or between a step and its report). The
productive time in status is the rank-0 log's steps counted once each (stepSeconds less data
wait), a step both attempts logged at the time of the attempt whose report first covered it:
the first attempt's up to the last step the operator saw it report (the next attempt's
steps_done, marked `recomputed` in its lines), the second's after that (the first attempt's
later lines were lost with it: nobody saw them)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from e2e_env import JOB, Env, attempt_log
from test_e2e_goodput import records

from hlat_testbed import faults

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pretrainjob-tiny.yaml"


def test_productive_time_is_the_logged_steps_counted_once(job_env: Env) -> None:
    spec = yaml.safe_load(EXAMPLE.read_text())["spec"]
    spec["train"]["steps"] = 200
    spec["checkpoint"]["async"] = True
    job_env.create(spec)
    job_env.wait("the checkpoint of step 20",
                 lambda s: (s.get("latestCheckpoint") or {}).get("step", 0) >= 20, 240)
    faults.kill(job_env.cluster.config, job_env.ns, f"{JOB}-a0-1")
    done = job_env.wait("Succeeded", lambda s: s.get("phase") == "Succeeded", 400)
    assert done["restarts"]["inPlace"] == 1, done["restarts"]
    g, b = done["goodput"], done["goodput"]["badputSeconds"]
    log = job_env.pod_log(0, 0)
    later = attempt_log(log, 1)
    first, second = records(log[:log.index(later)]), records(later)
    once: dict[int, float] = {}
    for r in first + second:
        once.setdefault(r["step"], r["stepSeconds"] - r["dataWaitSeconds"])
    assert sorted(once) == list(range(1, 201))
    logs = sum(once.values())
    # the trainers' own split: attempt 1 recomputes up to the last step the operator saw
    # attempt 0 report (steps_done), and counts the rest productive; the steps attempt 0
    # trained after that report and attempt 1 resumed past (its snapshot held them) count at
    # attempt 0's time (attempt 1 reports them: `carriedSeconds`)
    seen = min((r["step"] for r in second if not r["recomputed"]), default=201) - 1
    own = (sum(r["stepSeconds"] - r["dataWaitSeconds"] for r in first if r["step"] <= seen)
           + sum(r["stepSeconds"] - r["dataWaitSeconds"] for r in second if not r["recomputed"]))
    print(json.dumps({"productive": g["productiveSeconds"], "logs": logs, "own": own,
                      "lastLogged": max(r["step"] for r in first), "stepsDone": seen,
                      "wall": g["wallSeconds"], "badput": b}))
    # each step once: steps attempt 0 finished after its last report count at attempt 1's
    # time when attempt 1 trains them again, at attempt 0's when it resumed past them. A CI
    # run under load found status 0.63 s below the first attempt's line for every step
    # (`logs`): steps trained again differ by a difference of that sign when attempt 0 ran
    # them slower. Another found status 0.77 s below `own`: the three steps attempt 0 trained
    # after its last report, resumed past from memory, were counted by no one (now carried)
    assert max(r["step"] for r in first) >= seen
    assert g["productiveSeconds"] == pytest.approx(own, abs=0.5), (g, own, logs)
    # the example restarts in place with snapshots (memoryInterval auto, the default): work is
    # done again only when the state resumed from is older than the last step reported
    resumed = re.search(r"resumed from (?:checkpoint|in-memory snapshot) step_(\d+)", later)
    assert resumed, later[-2000:]
    assert (b["recompute"] > 0) == (int(resumed.group(1)) < seen), (resumed.group(0), seen, b)
    assert b["unreported"] == 0, b
    assert g["productiveSeconds"] + sum(b.values()) == pytest.approx(g["wallSeconds"], abs=0.05)
