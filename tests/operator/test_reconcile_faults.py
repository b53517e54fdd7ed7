"""Fault detection: which events end an attempt, how they are classified, and hang timeouts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest
from opfakes import SETTINGS, World, at, raw_spec

from hlat_api.heartbeat import Heartbeat
from hlat_api.labels import Reason
from hlat_api.spec import PretrainJobSpec
from hlat_operator.faults import classify_failed, staleness, steady_timeout
from hlat_operator.observe import ObservedLease, ObservedNode, ObservedPod


def running_world(**overrides: Any) -> World:
    w = World(raw_spec(**overrides))
    w.until("Running")
    w.beat(5)
    w.step()
    return w


def renew_all_but(w: World, excluded: str, **update: Any) -> None:
    """Every worker but `excluded` renews its Lease now, with `update` to its heartbeat."""
    for name, lease in list(w.leases.items()):
        if name != excluded and lease.heartbeat is not None:
            w.leases[name] = ObservedLease(name, w.now, lease.heartbeat.model_copy(update=update))


def seconds_until_restarting(w: World, each_second: Callable[[int], None]) -> int | None:
    """Let up to 30 s pass, `each_second(t)` after each; when the job turned Restarting."""
    for t in range(1, 30):
        w.advance(1)
        each_second(t)
        w.step()
        if w.status.phase == "Restarting":
            return t
    return None


@pytest.mark.parametrize(
    ("exit_code", "reason", "disruption", "expected", "permanent", "infra"),
    [
        (2, "Error", None, Reason.CONFIG_ERROR, True, False),
        (137, "Error", None, Reason.KILLED, False, False),
        (143, "Error", None, Reason.KILLED, False, False),
        (137, "OOMKilled", None, Reason.OOM_KILLED, False, False),
        (1, "Error", None, Reason.POD_FAILED, False, False),
        (None, "Evicted", None, Reason.EVICTED, False, True),
        (137, "Error", "PreemptionByScheduler", Reason.PREEMPTED, False, True),
        (None, "NodeLost", None, Reason.NODE_LOST, False, True),
        (143, None, "DeletionByTaintManager", Reason.NODE_LOST, False, True),
        (None, None, None, Reason.POD_FAILED, False, False),
    ],
)
def test_exit_codes_and_reasons_are_classified(
    exit_code: int | None,
    reason: str | None,
    disruption: str | None,
    expected: Reason,
    permanent: bool,
    infra: bool,
) -> None:
    pod = ObservedPod(
        "p",
        0,
        0,
        phase="Failed",
        exit_code=exit_code,
        reason=reason,
        node="n",
        disruption=disruption,
    )
    fault = classify_failed(pod)
    assert fault.reason == expected
    assert fault.permanent is permanent and fault.infrastructure is infra
    assert "p" in fault.message and fault.node == "n"


def test_a_config_error_fails_the_job_without_a_restart() -> None:
    w = running_world()
    w.fail(1, exit_code=2)
    w.step()
    assert w.status.phase == "Failed" and w.status.restarts.total == 0
    assert w.status.last_failure is not None and w.status.last_failure.reason == Reason.CONFIG_ERROR
    assert w.status.last_failure.exit_code == 2
    assert not w.live()  # the healthy worker is stopped too


def test_a_config_error_wins_over_a_simultaneous_retryable_failure() -> None:
    w = running_world()
    w.fail(0, exit_code=137)
    w.fail(1, exit_code=2)
    w.step()
    assert w.status.phase == "Failed"


def test_the_rank_that_failed_first_is_the_cause_not_the_peer_it_took_down() -> None:
    """rank 1 is SIGKILLed; rank 0's collective breaks and it exits 1 a second later. The
    operator sees both Failed in one pass (its previous pass lost to a conflict): the kill is
    the cause, whichever rank comes first in the list."""
    w = running_world()
    w.fail(1, exit_code=137)
    w.advance(1)
    w.fail(0, exit_code=1)
    w.step()
    assert w.status.last_failure is not None and w.status.last_failure.reason == Reason.KILLED
    assert w.status.last_failure.pod == "tiny-a0-1"


def test_failures_in_the_same_second_blame_the_signal_over_a_bare_exit_code() -> None:
    w = running_world()
    w.fail(0, exit_code=1)
    w.fail(1, exit_code=137)
    w.step()
    assert w.status.last_failure is not None and w.status.last_failure.reason == Reason.KILLED


def test_the_earlier_bare_exit_code_is_the_cause_when_it_came_first() -> None:
    w = running_world()
    w.fail(0, exit_code=1)
    w.advance(2)
    w.fail(1, exit_code=143)
    w.step()
    assert w.status.last_failure is not None and w.status.last_failure.reason == Reason.POD_FAILED
    assert w.status.last_failure.pod == "tiny-a0-0"


@pytest.mark.parametrize("exit_code", [137, 143, 1, 134])
def test_retryable_failures_restart_the_gang(exit_code: int) -> None:
    w = running_world()
    w.fail(0, exit_code=exit_code)
    w.step()
    assert w.status.phase == "Restarting"
    assert w.status.restarts.total == 1 and w.status.restarts.counted == 1
    assert w.events[-1].type == "Warning"


def test_a_pod_deleted_behind_the_operators_back_is_a_fault() -> None:
    w = running_world()
    del w.pods["tiny-a0-1"]
    w.step()
    assert w.status.phase == "Restarting"
    assert w.status.last_failure is not None
    assert w.status.last_failure.reason == Reason.POD_DELETED


def test_a_terminating_pod_is_a_fault() -> None:
    w = running_world()
    w.pods["tiny-a0-0"] = replace(w.pods["tiny-a0-0"], deletion_timestamp=w.now)
    w.step()
    assert w.status.last_failure is not None
    assert w.status.last_failure.reason == Reason.POD_DELETED


@pytest.mark.parametrize("how", ["not-ready", "gone", "unreachable", "unhealthy"])
def test_losing_a_workers_node_is_a_fault(how: str) -> None:
    w = running_world()
    node = w.pod_of(0).node
    assert node is not None
    if how == "not-ready":
        w.node_down(node)
    elif how == "gone":
        del w.nodes[node]
    elif how == "unreachable":  # tainted by the node lifecycle controller: no grace period
        w.nodes[node] = replace(w.nodes[node], ready=False, unreachable=True,
                                not_ready_since=w.now)
    else:
        w.nodes[node] = replace(w.nodes[node], health="UnschedulablePendingReplacement")
    w.step()
    assert w.status.phase == "Restarting"
    assert w.status.last_failure is not None and w.status.last_failure.node == node
    want = Reason.NODE_UNHEALTHY if how == "unhealthy" else Reason.NODE_LOST
    assert w.status.last_failure.reason == want


def test_a_node_that_nobody_reported_yet_is_not_lost() -> None:
    w = running_world()
    obs = replace(w.observed(), nodes={}, nodes_known=False)
    from hlat_operator.reconcile import decide

    d = decide(w.spec, w.status, obs, w.now, w.settings)
    assert d.fault is None


def test_a_recovered_node_still_tainted_unreachable_is_not_lost() -> None:
    """Ready again, the taint not yet lifted by the node lifecycle controller: no fault."""
    w = running_world()
    node = w.pod_of(0).node
    assert node is not None
    w.nodes[node] = replace(w.nodes[node], ready=True, unreachable=True)
    w.step()
    assert w.status.phase == "Running" and w.status.last_failure is None


def test_node_not_ready_grace() -> None:
    w = running_world()
    w.settings = SETTINGS.model_copy(update={"node_not_ready_grace_seconds": 20})
    node = w.pod_of(0).node
    assert node is not None
    w.node_down(node)
    w.step()
    assert w.status.phase == "Running"
    w.advance(21)
    w.step()
    assert w.status.phase == "Restarting"


def test_an_idle_node_going_down_is_not_a_fault() -> None:
    w = running_world()
    busy = {p.node for p in w.pods.values()}
    idle = next(n for n in w.nodes if n not in busy)
    w.node_down(idle)
    w.step()
    assert w.status.phase == "Running"


# --- heartbeats --------------------------------------------------------------------------------


def test_no_first_heartbeat_within_the_startup_timeout() -> None:
    w = World()
    w.until("Running")
    w.run(59)
    assert w.status.phase == "Running"
    w.run(3)
    assert w.status.phase == "Restarting"
    assert w.status.last_failure is not None
    assert w.status.last_failure.reason == Reason.STARTUP_TIMEOUT


def test_a_hung_worker_is_detected_within_the_learned_timeout() -> None:
    """step 0.5 s x safety 5 = 2.5 s, floored at 5 s, + one 2 s heartbeat period = 7 s."""
    w = running_world()
    hung = w.pod_of(1).name
    detected = seconds_until_restarting(w, lambda t: renew_all_but(w, hung, step=5 + t))
    assert detected is not None and 7 <= detected <= 8
    assert w.status.last_failure is not None
    assert w.status.last_failure.reason == Reason.HEARTBEAT_TIMEOUT
    assert w.status.last_failure.pod == hung


def test_an_explicit_steady_timeout_is_used_as_given() -> None:
    w = running_world(**{"faultTolerance.heartbeat.timeoutSeconds": 30})
    w.run(29)
    assert w.status.phase == "Running"
    w.run(3)
    assert w.status.last_failure is not None
    assert w.status.last_failure.reason == Reason.HEARTBEAT_TIMEOUT


def test_checkpointing_pauses_the_steady_timeout() -> None:
    w = World()
    w.until("Running")
    w.beat(20, phase="checkpointing")
    w.run(50)  # far beyond the 7 s steady timeout, within the 60 s startup bound
    assert w.status.phase == "Running"
    w.run(15)
    assert w.status.phase == "Restarting"


def test_a_hang_during_a_save_is_bounded_by_the_longest_save_so_far() -> None:
    """Longest save 2 s x safety 5 + a 2 s period = 12 s (more than the 7 s steady timeout)."""
    w = World()
    w.until("Running")
    w.beat(20, phase="checkpointing", checkpoint_seconds=2.0)
    w.run(11)
    assert w.status.phase == "Running"
    w.run(3)
    assert w.status.phase == "Restarting"


def test_a_worker_stuck_but_still_renewing_is_hung() -> None:
    """A loop blocked in a collective or the device runtime: its heartbeat thread renews, its
    progress stops; caught after the same steady timeout as a frozen process (7 s here)."""
    w = running_world()
    stuck_since = w.now
    detected = seconds_until_restarting(w, lambda _: w.beat(5, progress_time=stuck_since))
    assert detected is not None and 7 <= detected <= 8
    assert w.status.last_failure is not None
    assert w.status.last_failure.reason == Reason.HEARTBEAT_TIMEOUT
    assert "alive but no progress" in (w.status.last_failure.message or "")


def test_the_worker_that_stopped_renewing_is_blamed_over_peers_waiting_for_it() -> None:
    """Its peer, blocked in a collective with it, still renews, though it progressed last a
    little earlier (and so passes its timeout first): the silent one is the cause."""
    w = running_world()
    frozen = w.pod_of(1).name
    peer_progress = w.now - timedelta(seconds=0.4)
    detected = seconds_until_restarting(
        w, lambda _: renew_all_but(w, frozen, progress_time=peer_progress))
    assert detected is not None
    failure = w.status.last_failure
    assert failure is not None and failure.pod == frozen, failure
    assert "no heartbeat for" in (failure.message or "")


def test_a_worker_frozen_before_it_reported_training_is_blamed_for_the_peers_timeout() -> None:
    """Its last beat still says `starting` (startup timeout 60 s), so it is the stuck peer's
    steady timeout that runs out: the reason is HeartbeatTimeout, the blame the silent one's."""
    w = running_world()
    frozen = w.pod_of(1).name
    lease = w.leases[frozen]
    assert lease.heartbeat is not None
    w.leases[frozen] = replace(lease, heartbeat=lease.heartbeat.model_copy(
        update={"phase": "starting"}))
    stuck_since = w.now
    detected = seconds_until_restarting(
        w, lambda _: renew_all_but(w, frozen, progress_time=stuck_since))
    assert detected is not None and 7 <= detected <= 8
    failure = w.status.last_failure
    assert failure is not None and failure.pod == frozen, failure
    assert failure.reason == Reason.HEARTBEAT_TIMEOUT
    assert "no heartbeat for" in (failure.message or "") and "(timeout 7s)" in (failure.message or "")


def test_compiling_workers_get_the_startup_timeout() -> None:
    """Compiling is slow but bounded: the startup timeout (60 s here) from the last beat."""
    w = World()
    w.until("Running")
    w.beat(0, phase="compiling")
    w.run(50)
    assert w.status.phase == "Running"
    w.run(15)
    assert w.status.phase == "Restarting"
    assert w.status.last_failure is not None
    assert w.status.last_failure.reason == Reason.STARTUP_TIMEOUT


def test_a_finished_worker_is_not_expected_to_beat_but_to_exit() -> None:
    """After `finished` (its last checkpoint complete) a worker stops renewing; one still
    running after exitAfterFinish (hung in its exit, e.g. a collective in teardown) gets the
    gang restarted: the new gang resumes from the final checkpoint and has nothing to do."""
    w = running_world()
    w.beat(120, phase="finished")
    w.run(SETTINGS.exit_after_finish_seconds - 5)
    assert w.status.phase == "Running"
    w.run(10)
    assert w.status.phase == "Restarting"
    assert w.status.last_failure is not None
    assert w.status.last_failure.reason == Reason.HEARTBEAT_TIMEOUT


@pytest.mark.parametrize(
    ("timeout", "step_seconds", "expected"),
    [("auto", None, None), ("auto", 0.01, 5 + 2), ("auto", 4.0, 20 + 2), (90, 4.0, 90)],
)
def test_steady_timeout(timeout: Any, step_seconds: float | None, expected: float | None) -> None:
    spec = PretrainJobSpec.model_validate(
        raw_spec(**{"faultTolerance.heartbeat.timeoutSeconds": timeout})
    )
    assert steady_timeout(spec, step_seconds, SETTINGS) == expected


def test_a_heartbeat_of_another_attempt_is_no_sign_of_life() -> None:
    spec = PretrainJobSpec.model_validate(raw_spec())
    pod = ObservedPod("tiny-a1-0", 1, 0, phase="Running", started_at=at(100))
    old = ObservedLease("tiny-a1-0", at(150), Heartbeat(phase="training", step=9, attempt=0))
    stale = staleness(spec, pod, old, SETTINGS)
    assert stale is not None and stale.reason == Reason.STARTUP_TIMEOUT and stale.since == at(100)


def test_the_startup_clock_starts_when_the_last_worker_starts() -> None:
    spec = PretrainJobSpec.model_validate(raw_spec())
    pod = ObservedPod("tiny-a0-0", 0, 0, phase="Running", started_at=at(0))
    stale = staleness(spec, pod, None, SETTINGS, gang_started=at(40))
    assert stale is not None and stale.since == at(40)


def test_a_gang_placed_in_two_goes_gets_its_startup_time_from_the_later_pod() -> None:
    """Rank 1 waits 40 s for a node: rank 0 (started first) gets its 60 s from when rank 1
    started, since no worker can pass the rendezvous before its last peer is up."""
    w = World(nodes=("node-a",))
    w.run(40)  # rank 0 runs, rank 1 has no node
    assert w.status.phase == "Pending"
    w.nodes["node-b"] = ObservedNode("node-b")
    w.until("Running")
    w.run(50)
    assert w.status.phase == "Running" and w.status.restarts.total == 0, w.status.last_failure
    w.run(15)
    assert w.status.restarts.total == 1
    assert w.status.last_failure is not None
    assert w.status.last_failure.reason == Reason.STARTUP_TIMEOUT


def test_a_save_longer_than_ever_seen_is_still_bounded_by_the_startup_timeout() -> None:
    """A worker whose longest save was an hour is not given five hours in `checkpointing`: the
    startup timeout (60 s here) caps every bound."""
    w = World()
    w.until("Running")
    w.beat(20, phase="checkpointing", checkpoint_seconds=3600.0)
    w.run(58)
    assert w.status.phase == "Running"
    w.run(5)
    assert w.status.phase == "Restarting"
    assert w.status.last_failure is not None
    assert w.status.last_failure.reason == Reason.HEARTBEAT_TIMEOUT


def _raw_lease(renew: datetime, progress: datetime, written: datetime) -> dict[str, Any]:
    """A Lease as the API server returns it: the worker's times, the server's write stamp."""
    beat = Heartbeat(phase="training", step=5, attempt=0, step_seconds=0.5,
                     progress_time=progress)
    stamp = written.strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"metadata": {"name": "tiny-a0-0", "annotations": beat.to_annotations(),
                         "managedFields": [{"manager": "hlat-operator", "operation": "Update",
                                            "time": "2025-01-01T00:00:00Z"},
                                           {"manager": "OpenAPI-Generator",
                                            "operation": "Update", "time": stamp}]},
            "spec": {"renewTime": renew.isoformat()}}


@pytest.mark.parametrize("skew", [-60.0, 60.0])
def test_a_worker_clock_a_minute_off_neither_causes_nor_hides_a_hang(skew: float) -> None:
    """Behind, its fresh beats would look a minute old (a false hang, a restart loop); ahead,
    a hung worker would look alive for a minute more. Its times are read on the server's
    clock (the API server's write stamp), so the steady timeout (7 s here) holds either way."""
    from hlat_operator.observe import lease_from_raw

    spec = PretrainJobSpec.model_validate(raw_spec())
    pod = ObservedPod("tiny-a0-0", 0, 0, phase="Running", node="node-a", started_at=at(0))
    off = timedelta(seconds=skew)
    fresh = lease_from_raw(_raw_lease(at(100) + off, at(100) + off, at(100)))
    assert fresh.clock_offset == pytest.approx(skew)
    s = staleness(spec, pod, fresh, SETTINGS)
    assert s is not None and s.since == at(100) and s.timeout == pytest.approx(7.0, abs=1)
    hung = lease_from_raw(_raw_lease(at(120) + off, at(100) + off, at(120)))
    s = staleness(spec, pod, hung, SETTINGS)
    assert s is not None and (at(120) - s.since).total_seconds() > s.timeout  # caught at 120 s


def test_a_clock_within_the_server_s_resolution_is_left_as_it_is() -> None:
    from hlat_operator.observe import lease_from_raw

    renew = at(100) + timedelta(seconds=0.7)
    lease = lease_from_raw(_raw_lease(renew, renew, at(100)))
    assert lease.clock_offset == 0 and lease.renew_time == renew


def test_a_worker_that_finished_is_not_blamed_for_a_peer_s_hang() -> None:
    """Rank 0 finished and stopped renewing (by design); rank 1 hangs before finishing: the
    hang is rank 1's."""
    w = running_world()
    w.beat(120)
    rank0 = w.pod_of(0)
    lease = w.leases[rank0.name]
    assert lease.heartbeat is not None
    w.leases[rank0.name] = replace(lease, heartbeat=lease.heartbeat.model_copy(
        update={"phase": "finished"}))
    for _ in range(30):
        w.advance(1)
        w.step()
        if w.status.phase == "Restarting":
            break
    assert w.status.phase == "Restarting" and w.status.last_failure is not None
    assert w.status.last_failure.pod == "tiny-a0-1", w.status.last_failure
    assert "finished" not in w.status.last_failure.message


def _api_server_outage(w: World, seconds: float) -> None:
    """Nobody renews and every worker's node goes NotReady/unreachable for `seconds`; the
    operator sees none of it and gets the API server back at the end."""
    w.advance(seconds)
    for node in {p.node for p in w.live() if p.node}:
        w.nodes[node] = replace(w.nodes[node], ready=False, unreachable=True,
                                not_ready_since=w.now)
    w.seeing_since = w.now


def test_silence_while_the_api_server_was_away_is_neither_a_hang_nor_a_lost_node() -> None:
    w = running_world(**{"faultTolerance.heartbeat.timeoutSeconds": 6})
    _api_server_outage(w, 20)
    w.step()
    assert w.status.phase == "Running", w.status.last_failure
    w.advance(3)  # the workers renew within their period; the kubelets report Ready again
    w.beat(8)
    for node in w.nodes:
        w.node_up(node)
    w.run(10, step=9)
    assert w.status.phase == "Running" and w.status.last_failure is None


def test_after_an_outage_a_silent_worker_is_hung_once_its_timeout_ran_again() -> None:
    w = running_world(**{"faultTolerance.heartbeat.timeoutSeconds": 6})
    _api_server_outage(w, 20)
    for node in w.nodes:
        w.node_up(node)
    hung = w.pod_of(1).name
    detected = seconds_until_restarting(w, lambda t: renew_all_but(w, hung, step=6 + t))
    assert detected is not None and 6 <= detected <= 7, detected
    assert w.status.last_failure is not None and w.status.last_failure.pod == hung


def test_after_an_outage_a_node_still_not_ready_is_lost_after_the_grace() -> None:
    w = running_world(**{"faultTolerance.heartbeat.timeoutSeconds": 600})
    node = w.pod_of(0).node
    _api_server_outage(w, 20)
    for other in w.nodes:
        if other != node:
            w.node_up(other)
    grace = w.settings.api_return_grace_seconds
    w.run(grace - 1, step=7)
    assert w.status.phase == "Running"
    w.run(2, step=8)
    assert w.status.phase == "Restarting"
    assert w.status.last_failure is not None
    assert (w.status.last_failure.reason, w.status.last_failure.node) == (Reason.NODE_LOST, node)


def test_the_next_pass_is_due_when_the_first_heartbeat_timeout_runs_out() -> None:
    """Hang detection within a fraction of a second of the timeout, not up to a resync period
    (10 s here) later: a running gang's pass asks to be run again when the first worker's
    timeout (7 s: 5 x 0.5 s steps, at least 5 s, + a 2 s period) would run out."""
    w = running_world()
    w.advance(3)
    decision = w.step()
    assert decision.requeue_after == pytest.approx(7 - 3 + 0.1, abs=0.01)
    w.advance(4.1)
    w.step()
    assert w.status.phase == "Restarting"  # that pass found the hang
    assert w.status.last_failure is not None
    assert w.status.last_failure.reason == Reason.HEARTBEAT_TIMEOUT
