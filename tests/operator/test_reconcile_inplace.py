"""In-place restarts (`faultTolerance.restartStrategy: InPlace`), decided with a fake clock:
the pods stay and move to the new attempt, only those that are gone are recreated, the restart
record is written after everything the new attempt needs, and two in-place attempts in a row
that fail before training make the next restart recreate the gang."""

from __future__ import annotations

from dataclasses import replace

import pytest
from opfakes import World, raw_spec

from hlat_api import Env, labels
from hlat_api.gang import GangRecord
from hlat_api.labels import Reason
from hlat_operator.observe import ObservedPod, parse_time
from hlat_operator.reconcile import CreateObject, Decision, DeletePod, PatchPod, PatchStatus


def in_place_world() -> World:
    w = World(raw_spec(**{"faultTolerance.restartStrategy": "InPlace"}))
    w.until("Running")
    w.beat(5)
    w.step()
    return w


def created(d: Decision, kind: str) -> list[str]:
    return [a.obj["metadata"]["name"] for a in d.actions
            if isinstance(a, CreateObject) and a.obj["kind"] == kind]


def record_of(w: World) -> GangRecord | None:
    gang = w.objects.get(("Lease", labels.gang_lease_name("tiny")))
    return None if gang is None else GangRecord.from_annotations(gang["metadata"]["annotations"])


def lose_node_of(w: World, rank: int) -> ObservedPod:
    """Take down the node of `rank`'s pod and run passes until the operator restarts."""
    lost = w.pod_of(rank)
    assert lost.node is not None
    w.node_down(lost.node)
    for _ in range(120):
        w.step()
        if w.status.phase == "Restarting":
            return lost
        w.advance(1)
    raise AssertionError(f"the loss of {lost.node} was never acted on")


def restart(w: World, hit: int | None = None) -> Decision | None:
    """Passes until the attempt after `hit` (the attempt a fault hit; default: the status's) is
    published; returns that pass's decision, or None when the fault's own pass published it
    (every pod kept and no backoff due: the next attempt starts in that pass)."""
    attempt = w.status.attempt if hit is None else hit
    if w.status.attempt > attempt:
        return None
    for _ in range(60):
        w.schedule()
        d = w.step()
        if w.status.attempt > attempt:
            return d
        w.advance(1)
    raise AssertionError(f"attempt {attempt + 1} never started: {w.status.conditions}")


def test_a_trainer_exit_restarts_every_trainer_in_the_pods_it_has() -> None:
    w = in_place_world()
    pods = sorted(w.pods)
    assert record_of(w) == GangRecord(attempt=0, steps_done=0)
    w.trainer_exit(1, 137)
    d = w.step()
    assert w.status.phase == "Restarting"
    assert w.status.last_failure is not None and w.status.last_failure.reason == "Killed"
    assert not [a for a in d.actions if isinstance(a, DeletePod)]  # nothing torn down
    d = restart(w)
    assert sorted(w.pods) == pods  # the same pods ...
    assert {p.attempt for p in w.pods.values()} == {1}  # ... now of attempt 1
    assert sorted(a.name for a in d.actions if isinstance(a, PatchPod)) == pods
    assert created(d, "Pod") == []
    assert record_of(w) == GangRecord(attempt=1, steps_done=5,
                                      ranks={"tiny-a0-0": 0, "tiny-a0-1": 1}, nodes=2)
    assert w.status.restarts.total == 1 and w.status.restarts.in_place == 1
    assert w.status.phase == "Pending"
    w.beat(6)
    w.step()
    assert w.status.phase == "Running"


def test_a_trainer_exit_after_progress_starts_the_next_attempt_in_the_pass_that_sees_it(
) -> None:
    """Every pod stays and no backoff is due (the attempt made a checkpoint): the pass that
    sees the exit publishes the next attempt too, with no second pass in between. Its one
    status write (the restart counted, the new attempt) comes before every object of the new
    attempt, and the restart record last."""
    w = in_place_world()
    w.beat(10, checkpoint_step=10)
    w.step()
    w.trainer_exit(1, 137)
    d = w.step()
    assert w.status.attempt == 1 and w.status.phase == "Pending", w.status.conditions
    assert w.status.restarts.total == 1 and w.status.restarts.in_place == 1
    assert any(c.type == "Restarting" and c.status == "True" for c in w.status.conditions)
    writes = [i for i, a in enumerate(d.actions) if isinstance(a, PatchStatus)]
    objects = [i for i, a in enumerate(d.actions) if isinstance(a, CreateObject | PatchPod)]
    assert len(writes) == 1 and objects and writes[0] < objects[0]
    last = d.actions[objects[-1]]
    assert isinstance(last, CreateObject) and last.obj["metadata"]["name"] == "tiny-gang"
    assert record_of(w) == GangRecord(attempt=1, steps_done=10,
                                      ranks={"tiny-a0-0": 0, "tiny-a0-1": 1}, nodes=2)


def test_of_two_trainer_exits_seen_together_the_signal_is_blamed() -> None:
    """rank 1's trainer is killed and rank 0's exits 1 on the broken collective; both reports
    are on the Leases by the operator's next pass: the kill is the cause."""
    w = in_place_world()
    w.trainer_exit(0, 1)
    w.trainer_exit(1, 137)
    w.step()
    assert w.status.last_failure is not None and w.status.last_failure.reason == "Killed"
    assert w.status.last_failure.pod == "tiny-a0-1"


@pytest.mark.parametrize(("reason", "expected"), [("OOMKilled", "OOMKilled"),
                                                  (None, "Killed"), ("Evicted", "Killed")])
def test_a_trainer_the_kernel_killed_for_memory_is_reported_oomkilled(
        reason: str | None, expected: str) -> None:
    """The launcher's word for a SIGKILL (the container's memory cgroup counted an OOM kill)
    names the fault, as a container's OOMKilled would; it cannot claim anything else."""
    w = in_place_world()
    w.trainer_exit(0, 137, reason)
    w.step()
    failure = w.status.last_failure
    assert failure is not None and failure.reason == expected
    assert ("ran out of memory" in failure.message) == (expected == "OOMKilled")
    assert w.status.phase == "Restarting"


def test_the_restart_record_is_written_last() -> None:
    """A launcher restarts its trainer when it reads the record: by then the Role must name
    only the new attempt's Leases (fencing the old trainers), and every pod must be there."""
    w = in_place_world()
    w.trainer_exit(0, 1)
    w.step()
    d = restart(w)
    order = [(type(a).__name__, getattr(a, "obj", {}).get("kind", ""),
              getattr(a, "obj", {}).get("metadata", {}).get("name", ""))
             for a in d.actions if isinstance(a, CreateObject | PatchPod)]
    gang = ("CreateObject", "Lease", "tiny-gang")
    assert order[-1] == gang
    assert ("CreateObject", "Role", "tiny-worker") in order[:-1]
    role = w.objects[("Role", "tiny-worker")]
    assert role["rules"][0]["resourceNames"] == ["tiny-a1-0", "tiny-a1-1"]


def test_only_the_pod_of_a_lost_node_is_recreated() -> None:
    w = in_place_world()
    lost = lose_node_of(w, 1)
    assert w.status.last_failure is not None and w.status.last_failure.reason == "NodeLost"
    d = restart(w)
    assert created(d, "Pod") == ["tiny-a1-1"]
    kept = w.pods["tiny-a0-0"]
    assert kept.attempt == 1 and lost.name not in w.pods
    w.schedule()
    assert w.pods["tiny-a1-1"].node != lost.node  # the failed node is avoided


def test_two_in_place_attempts_failing_before_training_recreate_the_gang() -> None:
    w = in_place_world()
    w.trainer_exit(1)
    w.step()
    restart(w)  # attempt 1, in place
    w.trainer_exit(1)  # fails before any worker trained
    w.step()
    restart(w)  # attempt 2, in place again
    assert w.status.restarts.in_place == 2
    w.trainer_exit(0)
    d = w.step()
    message = next(c.message for c in w.status.conditions if c.type == "Restarting")
    assert "2 in-place attempts in a row failed" in message
    assert sorted(a.name for a in d.actions if isinstance(a, DeletePod)) == [
        "tiny-a0-0", "tiny-a0-1"]  # the whole gang goes
    restart(w)
    assert sorted(w.pods) == ["tiny-a3-0", "tiny-a3-1"]
    assert w.status.restarts.in_place == 2 and w.status.restarts.total == 3


def test_an_in_place_attempt_that_trained_resets_the_fallback_count() -> None:
    w = in_place_world()
    for attempt in range(1, 4):
        w.trainer_exit(1)
        w.step()
        restart(w)
        w.schedule()
        w.step()
        w.beat(5 + attempt)  # every worker of the attempt trains
        w.step()
        assert w.status.attempt == attempt and w.status.restarts.in_place == attempt
    assert sorted(w.pods) == ["tiny-a0-0", "tiny-a0-1"]


def spare_world(nodes: int = 2, spares: int = 1) -> World:
    """An InPlace job of `nodes` nodes (a global batch every rank has a micro-batch of) with
    `spares` spare nodes, on enough rig nodes for all of them and one more, Running."""
    w = World(raw_spec(**{"nodes": nodes, "train.globalBatch": 4 * nodes,
                          "faultTolerance.restartStrategy": "InPlace",
                          "faultTolerance.spareNodes": spares}),
              nodes=tuple(f"node-{i}" for i in range(nodes + spares + 1)))
    w.until("Running")
    for _ in range(3):
        w.schedule()
        w.beat(5)
        w.step()
    return w


def test_a_spare_is_kept_running_outside_the_gang_and_shown_in_status() -> None:
    w = spare_world()
    spare = w.pods["tiny-s0"]
    assert spare.spare and spare.attempt is None and spare.phase == "Running"
    assert spare.hostname == "tiny-s0"
    assert w.status.spares is not None
    assert (w.status.spares.wanted, w.status.spares.ready, w.status.spares.promoted) == (1, 1, 0)
    w.step()
    assert sorted(w.pods) == ["tiny-a0-0", "tiny-a0-1", "tiny-s0"]  # no second spare


def test_a_lost_node_s_rank_moves_to_the_ready_spare_without_waiting_for_its_pod() -> None:
    w = spare_world()
    lose_node_of(w, 1)
    d = restart(w)  # the backoff only: not the force-delete bound of the dead node's pod
    assert w.status.last_failure is not None
    failed_at = parse_time(w.status.last_failure.time)
    assert failed_at is not None
    assert (w.now - failed_at).total_seconds() < w.settings.force_delete_after_seconds
    promoted = [a for a in d.actions if isinstance(a, PatchPod) and a.name == "tiny-s0"]
    assert promoted and promoted[0].labels == {labels.ATTEMPT: "1", labels.NODE_RANK: "1",
                                               labels.SPARE: None}
    assert created(d, "Pod") == []  # no cold pod for rank 1
    # one event says the new attempt and what it kept, promoted and created
    (said,) = [e.message for e in w.events
               if e.reason == Reason.CREATED and e.message.startswith("attempt 1 ")]
    assert "pods of node ranks [0] kept, spares tiny-s0 -> rank 1, 0 created" in said, said
    record = record_of(w)
    assert record is not None and record.ranks == {"tiny-a0-0": 0, "tiny-s0": 1}
    assert record.master_addr is None  # rank 0 kept its pod
    assert w.pods["tiny-s0"].rank == 1 and not w.pods["tiny-s0"].spare
    w.beat(6)
    w.step()
    w.schedule()
    w.step()
    assert "tiny-s1" in w.pods and w.pods["tiny-s1"].spare  # a new spare is requested
    assert w.status.spares is not None and w.status.spares.promoted == 1


def test_a_spare_that_takes_rank_0_becomes_the_rendezvous_master() -> None:
    w = spare_world()
    lose_node_of(w, 0)
    restart(w)
    record = record_of(w)
    assert record is not None and record.ranks == {"tiny-s0": 0, "tiny-a0-1": 1}
    assert record.master_addr == "tiny-s0.tiny"


def test_a_pod_made_beside_a_spare_that_took_rank_0_is_told_rank_0_s_address() -> None:
    """Two nodes lost, one spare: the spare takes rank 0 and rank 1 gets a new pod, whose
    launcher starts its trainers before it reads any restart record: its MASTER_ADDR must
    already be the spare's, or its rank waits at a rendezvous no one else joins."""
    w = spare_world()
    second = w.pod_of(1).node
    assert second is not None
    w.node_down(second)
    lose_node_of(w, 0)
    d = restart(w)
    assert d is not None
    record = record_of(w)
    assert record is not None and record.master_addr == "tiny-s0.tiny"
    (made,) = [a.obj for a in d.actions if isinstance(a, CreateObject)
               and a.obj["kind"] == "Pod" and a.obj["metadata"]["labels"].get(labels.NODE_RANK)]
    assert made["metadata"]["labels"][labels.NODE_RANK] == "1"
    env = {e["name"]: e.get("value") for e in made["spec"]["containers"][0]["env"]}
    assert env[Env.MASTER_ADDR] == "tiny-s0.tiny"


def test_a_spare_is_requested_only_once_the_attempt_trains() -> None:
    """Not while a rank waits for a node (no scheduler may give the spare that node: Volcano
    orders one group's pods by creation second, then UID), nor while the ranks start (a
    replacement spare's start must not compete with the restart it follows)."""
    w = World(raw_spec(**{"faultTolerance.restartStrategy": "InPlace",
                          "faultTolerance.spareNodes": 1}))
    for _ in range(5):  # the gang's pods created, none placed yet
        w.step()
        w.advance(1)
    assert sorted(w.pods) == ["tiny-a0-0", "tiny-a0-1"]
    assert not any(pod.node for pod in w.pods.values())
    w.schedule()
    w.beat(0, phase="starting")
    for _ in range(3):  # placed and running, not yet training
        w.step()
        w.advance(1)
    assert w.status.phase == "Running" and "tiny-s0" not in w.pods
    w.beat(1)
    w.step()
    assert "tiny-s0" in w.pods


def test_a_spare_still_starting_is_not_replaced() -> None:
    w = World(raw_spec(**{"faultTolerance.restartStrategy": "InPlace",
                          "faultTolerance.spareNodes": 1}))
    w.until("Running")
    w.beat(1)
    w.step()
    assert "tiny-s0" in w.pods
    w.pods["tiny-s0"] = replace(w.pods["tiny-s0"], node="node-c", phase="Pending")  # pulling
    for _ in range(5):
        w.step()
        w.advance(1)
    assert sorted(n for n in w.pods if "-s" in n) == ["tiny-s0"]
