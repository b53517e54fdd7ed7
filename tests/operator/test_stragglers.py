"""Straggler detection: scoring a node against its gang, the window, and what a job shows."""

from __future__ import annotations

import random
import re
from datetime import timedelta
from typing import Any

import pytest
from opfakes import World, raw_spec

from hlat_api import labels
from hlat_api.heartbeat import CHECKPOINT_REQUEST, Activity, Heartbeat
from hlat_operator import stragglers
from hlat_operator.metrics import OperatorMetrics
from hlat_operator.observe import ObservedLease, parse_time
from hlat_operator.reconcile import Decision


def test_a_node_is_scored_against_the_median_of_the_others_not_an_absolute_figure() -> None:
    ratios = stragglers.slowdowns({"a": 0.13, "b": 0.10, "c": 0.10, "d": 0.11})
    assert round(ratios["a"], 2) == 1.3 and round(ratios["b"], 2) == 0.91
    # a bigger model or a busier host moves every node alike: the scores do not move
    doubled = stragglers.slowdowns({"a": 0.26, "b": 0.20, "c": 0.20, "d": 0.22})
    assert doubled == pytest.approx(ratios)
    assert stragglers.slowdowns({"a": 9.0}) == {}  # one node: nothing to compare it with


def test_a_node_is_flagged_only_after_the_window_and_starts_over_when_back_under() -> None:
    now = World().now
    ratios = {"a": 1.4, "b": 0.7}
    flagged, over = stragglers.judge(ratios, {}, now, 0.2, 30, 20)
    assert flagged == [] and over == {"a": stragglers.Spell(now)}
    later = now + timedelta(seconds=29)
    assert stragglers.judge(ratios, over, later, 0.2, 30, 20)[0] == []
    flagged, _ = stragglers.judge(ratios, over, now + timedelta(seconds=30), 0.2, 30, 20)
    assert [(s.node, s.since) for s in flagged] == [("a", now)]
    _, over = stragglers.judge({"a": 1.1, "b": 0.9}, over, later, 0.2, 30, 20)
    _, over = stragglers.judge({"a": 1.1, "b": 0.9}, over, later + timedelta(seconds=21), 0.2,
                               30, 20)
    assert over == {}  # back under the threshold for longer than the grace: starts afresh


def test_a_dip_under_the_threshold_shorter_than_the_grace_does_not_restart_the_window() -> None:
    """What a CI run saw: a 30%-slow node's ratio dipped under 1.2 for one heartbeat renewal
    at 30 s (a healthy node's median compute rose), and the window began again: flagged after
    64 s where the window is 30. Within the grace the node keeps its since, is not flagged
    while under, and is flagged as soon as it is back over."""
    now = World().now
    at = [now + timedelta(seconds=t) for t in range(0, 60)]
    _, over = stragglers.judge({"a": 1.4, "b": 1.0}, {}, at[0], 0.2, 30, 20)
    _, over = stragglers.judge({"a": 1.4, "b": 1.0}, over, at[20], 0.2, 30, 20)
    flagged, over = stragglers.judge({"a": 1.15, "b": 1.0}, over, at[29], 0.2, 30, 20)
    assert flagged == [] and over == {"a": stragglers.Spell(now, at[29])}
    flagged, over = stragglers.judge({"a": 1.15, "b": 1.0}, over, at[35], 0.2, 30, 20)
    assert flagged == [] and over == {"a": stragglers.Spell(now, at[29])}  # under since 29
    flagged, over = stragglers.judge({"a": 1.4, "b": 1.0}, over, at[39], 0.2, 30, 20)
    assert [(s.node, s.since) for s in flagged] == [("a", now)]
    assert over == {"a": stragglers.Spell(now)}
    # a node that stops reporting is under, too: its spell is kept for the grace, then dropped
    _, over = stragglers.judge({"b": 1.0}, over, at[40], 0.2, 30, 20)
    assert over == {"a": stragglers.Spell(now, at[40])}
    kept = {"a": stragglers.Spell(now, at[40])}
    assert stragglers.judge({"b": 1.0}, over, at[59], 0.2, 30, 20)[1] == kept
    assert stragglers.judge({"b": 1.0}, over, at[40] + timedelta(seconds=21), 0.2, 30, 20)[1] == {}


def test_healthy_nodes_with_noisy_step_times_raise_no_flag() -> None:
    """8 nodes, each step's compute time drawn with 10% noise, each node's report the median of
    its last 20 steps (what a worker sends): over 1000 reports no healthy node ever crosses
    1.2x; a node 30% slower (compute x 1/0.7) is over in every report."""
    rng = random.Random(7)
    windows: dict[str, list[float]] = {f"n{i}": [] for i in range(8)}

    def report(slow: dict[str, float]) -> dict[str, float]:
        for node, window in windows.items():
            window.append(0.1 * slow.get(node, 1.0) * rng.gauss(1.0, 0.1))
            del window[:-20]
        return {n: sorted(w)[len(w) // 2] for n, w in windows.items()}

    for slow in ({}, {"n5": 1 / 0.7}):
        for _ in range(40):
            report(slow)  # the windows fill with this regime first
        over = [{n for n, r in stragglers.slowdowns(report(slow)).items() if r > 1.2}
                for _ in range(1000)]
        assert all(nodes == set(slow) for nodes in over), (slow, [o for o in over if o][:5])


def _beat_compute(w: World, compute: dict[int, float], step: int,
                  checkpoint: int | None = None, data_wait: dict[int, float] | None = None,
                  host: dict[int, float] | None = None,
                  phases: dict[int, str] | None = None) -> None:
    """Every running worker renews, node rank r reporting compute time `compute[r]` (and a
    data wait of `data_wait[r]` and host work of `host[r]`, none by default), in phase
    `phases[r]` (training by default)."""
    for pod in w.pods.values():
        if pod.phase != "Running" or pod.attempt is None or pod.rank is None or pod.spare:
            continue
        name = labels.worker_lease_name("tiny", pod.attempt, pod.rank)
        hb = Heartbeat(phase=(phases or {}).get(pod.rank, "training"), step=step,
                       attempt=pod.attempt, step_seconds=0.5,
                       compute_seconds=compute[pod.rank], checkpoint_step=checkpoint,
                       data_wait_seconds=(data_wait or {}).get(pod.rank),
                       host_seconds=(host or {}).get(pod.rank),
                       activity=Activity(productive=step * 0.5), progress_time=w.now)
        w.leases[name] = ObservedLease(name, w.now, hb)


def _condition(w: World) -> dict[str, Any]:
    return next((c.model_dump() for c in w.status.conditions if c.type == "Straggler"), {})


def test_the_job_names_the_slow_node_after_the_window_then_clears_it() -> None:
    w = World(raw_spec(faultTolerance={"stragglers": {"threshold": 0.2, "windowSeconds": 30}}))
    w.until("Running")
    slow_node = next(p.node for p in w.pods.values() if p.rank == 1)
    step = 10
    decision: Decision | None = None
    for _ in range(20):  # healthy: nothing flagged
        _beat_compute(w, {0: 0.10, 1: 0.104}, step)
        decision = w.step()
        w.advance(2)
        step += 4
    assert _condition(w) == {} and decision is not None
    assert decision.slowdowns[slow_node] < 1.2
    assert w.status.goodput.badput_seconds.straggler == 0  # within the threshold: no badput
    flagged_at, slow_from = None, w.now
    for t in range(0, 60, 2):  # rank 1's node slowed by 30%: compute x 1/0.7
        _beat_compute(w, {0: 0.10, 1: 0.143}, step)
        decision = w.step()
        if _condition(w).get("status") == "True" and flagged_at is None:
            flagged_at = t
        w.advance(2)
        step += 3
    assert flagged_at == 30, flagged_at  # not before the window, not a resync later
    shown = _condition(w)
    assert shown["reason"] == "Straggler" and shown["message"].startswith(
        f"node {slow_node} takes 1.43x the median of the other nodes' time a step"), shown
    warnings = [e for e in w.events if e.reason == "Straggler"]
    assert len(warnings) == 1 and warnings[0].type == "Warning"  # once, not every pass
    assert w.status.restarts.total == 0 and w.status.phase == "Running"
    # goodput: the time the others waited for it, (0.143 - 0.10) s of every 0.5 s step, for
    # as long as it was slow up to the status's time (from its first slow report: the window
    # counted on the pass that flags it, not before; a noisy node never flagged costs none)
    g = w.status.goodput
    slow_seconds = (parse_time(w.status.accounted_at) - slow_from).total_seconds()
    assert slow_seconds > 40
    assert g.badput_seconds.straggler == pytest.approx(slow_seconds * 0.043 / 0.5, rel=0.01)
    assert g.productive_seconds + sum(g.badput_seconds.model_dump().values()) == pytest.approx(
        g.wall_seconds, abs=0.01)
    metrics = OperatorMetrics()
    metrics.observe("default", "tiny", decision)
    body = metrics.render().decode()
    series = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
              if line.startswith("hlat_node_step_slowdown_ratio{")}
    mine = [v for k, v in series.items() if f'node="{slow_node}"' in k and 'job="tiny"' in k]
    assert mine == [pytest.approx(1.43)] and len(series) == 2, series
    # the alert's input: the nodes the job's own rule flags, and only those
    job = {"namespace": "default", "pretrainjob": "tiny"}
    flag = metrics.registry.get_sample_value
    assert flag("hlat_node_straggler", {**job, "node": slow_node}) == 1
    assert [k for k in body.splitlines() if k.startswith("hlat_node_straggler{")] == [
        f'hlat_node_straggler{{namespace="default",node="{slow_node}",pretrainjob="tiny"}} 1.0']
    # fast again: still flagged through the grace (one renewal under is a dip), then cleared
    grace = stragglers.GRACE_PERIODS * w.settings.heartbeat_period_seconds
    for t in range(0, int(grace) + 4, 2):
        _beat_compute(w, {0: 0.10, 1: 0.10}, step)
        metrics.observe("default", "tiny", w.step())
        assert (_condition(w)["status"] == "True") == (t <= grace), t
        w.advance(2)
    assert _condition(w)["reason"] == "NoStraggler"
    assert flag("hlat_node_straggler", {**job, "node": slow_node}) is None


def test_a_flagged_node_hovering_at_the_threshold_stays_flagged_through_a_dip() -> None:
    """What CI saw of a node at the threshold: flagged, back under for one renewal, over
    again, three Warning events in 18 s and the condition False in between. A node flagged
    before it dips stays flagged for the grace (two heartbeat periods): one event, the
    condition True throughout; under for longer than the grace, it is cleared."""
    w = World(raw_spec(faultTolerance={"stragglers": {"threshold": 0.2, "windowSeconds": 30}}))
    w.until("Running")
    grace = stragglers.GRACE_PERIODS * w.settings.heartbeat_period_seconds
    step, shown = 10, []

    def beats(slow: float, seconds: float) -> None:
        nonlocal step
        for _ in range(int(seconds // 2)):
            _beat_compute(w, {0: 0.10, 1: slow}, step)
            step += 3
            w.step()
            shown.append(_condition(w).get("status"))
            w.advance(2)

    beats(0.143, 40)  # 1.43x: flagged once the window is up
    assert shown[-1] == "True"
    flagged_at = len(shown)
    for _ in range(3):  # at the threshold: under for a renewal, over for two
        beats(0.115, grace / 2)
        beats(0.14, grace)
    assert set(shown[flagged_at - 1:]) == {"True"}, shown
    assert len([e for e in w.events if e.reason == "Straggler"]) == 1
    beats(0.10, grace + 4)  # under for longer than the grace: cleared
    assert shown[-1] == "False" and _condition(w)["reason"] == "NoStraggler"


def test_a_node_starting_or_compiling_is_not_scored_however_long_its_steps() -> None:
    """A node whose worker is back in a start (compiling its graphs, loading a checkpoint:
    its heartbeat's compute is its first steps', or the last attempt's) is not compared with
    its gang however long that lasts: a fault, or a restart's warm-up, is not a slow node.
    Once it trains at its gang's pace nothing is flagged either."""
    w = World(raw_spec(faultTolerance={"stragglers": {"threshold": 0.2, "windowSeconds": 30}}))
    w.until("Running")
    step = 10
    for phase in ("compiling", "starting"):
        for _ in range(25):  # 50 s: longer than the window
            _beat_compute(w, {0: 0.10, 1: 5.0}, step, phases={1: phase})
            decision = w.step()
            assert list(decision.slowdowns) == [] and _condition(w) == {}, decision.slowdowns
            w.advance(2)
    for _ in range(25):
        _beat_compute(w, {0: 0.10, 1: 0.105}, step)
        step += 4
        assert w.step().slowdowns and _condition(w) == {}
        w.advance(2)
    assert not [e for e in w.events if e.reason == "Straggler"]


@pytest.mark.parametrize("held_back_by", ["data_wait", "host"])
def test_a_node_held_back_by_its_data_path_or_its_host_is_flagged_as_a_slow_chip_is(
        held_back_by: str) -> None:
    """A failing disk under one node's data (its wait for its own batches), or a noisy
    neighbour on its host (its optimizer update): its compute is its gang's, its own time is 45
    ms a step more (the others wait for it in their collectives, counted as sync). Flagged after
    the window, with the ratio of its own time (compute, data wait, host work) to the
    others'."""
    w = World(raw_spec(faultTolerance={"stragglers": {"threshold": 0.2, "windowSeconds": 30}}))
    w.until("Running")
    slow_node = next(p.node for p in w.pods.values() if p.rank == 1)
    step = 10
    for _ in range(40):
        _beat_compute(w, {0: 0.10, 1: 0.10}, step, **{held_back_by: {0: 0.001, 1: 0.046}})
        w.step()
        w.advance(2)
        step += 3
    shown = _condition(w)
    assert shown.get("status") == "True", shown
    assert shown["message"].startswith(
        f"node {slow_node} takes 1.45x the median of the other nodes' time a step"), shown


def test_replace_moves_the_slow_node_s_rank_to_a_spare_at_the_next_checkpoint() -> None:
    """action Replace with a ready spare: a checkpoint is asked for at the flag, and nothing
    moves before a checkpoint completed after the flag; then an in-place restart (no budget used) deletes the slow node's pod, avoids the
    node, and the spare takes its rank."""
    w = World(raw_spec(**{"faultTolerance.restartStrategy": "InPlace",
                          "faultTolerance.spareNodes": 1,
                          "faultTolerance.stragglers": {"action": "Replace",
                                                        "windowSeconds": 30}}))
    w.until("Running")
    for _ in range(3):  # the spare comes once the attempt trains
        w.schedule()
        _beat_compute(w, {0: 0.10, 1: 0.10}, 5, checkpoint=4)
        w.step()
    assert w.pods["tiny-s0"].phase == "Running"
    slow = w.pod_of(1)
    for t in range(0, 50, 2):  # flagged at 30 s, but the newest checkpoint predates the flag
        _beat_compute(w, {0: 0.10, 1: 0.15}, 10 + t, checkpoint=4)
        w.step()
        w.advance(2)
        if t < 30:
            assert not w.lease_patches, t
    assert _condition(w)["status"] == "True" and w.status.phase == "Running"
    assert w.status.restarts.total == 0 and "tiny-a0-1" in w.pods
    # so a checkpoint is asked for now (one value, however many passes ask), not an interval on
    assert {(a.name, a.annotations[CHECKPOINT_REQUEST]) for a in w.lease_patches} == {
        ("tiny-a0-0", "5"), ("tiny-a0-1", "5")}
    _beat_compute(w, {0: 0.10, 1: 0.15}, 62, checkpoint=60)  # the next checkpoint completes
    w.step()
    w.advance(1)
    _beat_compute(w, {0: 0.10, 1: 0.15}, 63, checkpoint=60)
    w.step()
    # already restarted: the attempt made progress (step_60), so no backoff
    assert w.status.phase == "Pending", w.status.conditions
    failure = w.status.last_failure
    assert failure is not None and failure.reason == "Straggler" and failure.node == slow.node
    assert "moves to spare tiny-s0 at checkpoint step_60" in failure.message
    assert (w.status.restarts.total, w.status.restarts.counted) == (1, 0)  # no budget used
    assert [a.node for a in w.status.avoided_nodes] == [slow.node]
    assert "tiny-a0-1" not in w.pods  # deleted: the spare takes its rank
    for _ in range(10):
        w.schedule()
        w.step()
        w.advance(1)
        if w.status.attempt == 1:
            break
    assert w.pods["tiny-s0"].rank == 1 and not w.pods["tiny-s0"].spare
    assert w.pods["tiny-a0-0"].rank == 0 and w.status.attempt == 1


def test_replace_without_a_spare_restarts_off_the_node_once_it_cost_more_than_a_restart(
) -> None:
    """No spare: the slow node stays while the time it cost is under what a restart of this
    job costs (measured: its attempts' starts from goodput, plus the backoff); once over, at a
    checkpoint, the job restarts off it (node avoided, no budget used, the message saying
    both figures)."""
    w = World(raw_spec(**{"faultTolerance.restartStrategy": "InPlace",
                          "faultTolerance.stragglers": {"action": "Replace",
                                                        "windowSeconds": 30}}))
    w.until("Running")
    w.advance(20)  # the gang's start, charged as pending at the first report
    slow = w.pod_of(1)
    step, t = 10, 0
    while w.status.phase == "Running" and t < 600:
        _beat_compute(w, {0: 0.10, 1: 0.15}, step, checkpoint=step - step % 4)
        w.step()
        if t == 60:  # flagged, 6 s lost (0.05 of every 0.5 s step): under a restart's cost
            assert _condition(w)["status"] == "True" and w.status.restarts.total == 0
            assert not w.lease_patches  # no checkpoint asked for a move not due
        w.advance(2)
        step, t = step + 1, t + 2
    failure = w.status.last_failure
    assert failure is not None and failure.reason == "Straggler" and failure.node == slow.node
    lost, cost = (float(x) for x in re.findall(
        r"has cost (\d+)s, more than a restart \((\d+)s measured\)", failure.message)[0])
    assert lost >= cost > 4 + 10, failure.message  # the backoff + the measured start
    assert 0.1 * t == pytest.approx(lost, abs=4), (t, failure.message)  # moved once it paid
    assert (w.status.restarts.total, w.status.restarts.counted) == (1, 0)
    assert [a.node for a in w.status.avoided_nodes] == [slow.node]
    assert "tiny-a0-1" not in w.pods  # recreated elsewhere, not restarted on the slow node
