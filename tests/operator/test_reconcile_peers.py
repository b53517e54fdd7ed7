"""A lost node found by its peers (hlat_trainer.peers: the launchers of its neighbours reached
it, then could not), decided with a fake clock: the operator acts on the report at once, as a
lost node, without waiting for the Node to turn NotReady; peers cut off from each other, or
reports read right after an outage of the API server, are not a lost node."""

from __future__ import annotations

from datetime import timedelta

from opfakes import World
from test_reconcile_inplace import restart, spare_world

from hlat_operator.faults import PEER_SETTLE_SECONDS
from hlat_operator.reconcile import PatchPod


def peer_world(nodes: int = 3, spares: int = 1) -> World:
    return spare_world(nodes, spares)


def test_a_node_its_peers_cannot_reach_is_lost_at_once_and_its_rank_moves_to_the_spare(
) -> None:
    w = peer_world()
    lost = w.pod_of(1)
    w.peers_unreachable(0, [1])
    w.peers_unreachable(2, [1])
    w.step()  # no time passes: the Node is still Ready
    assert w.status.phase == "Restarting", w.status.conditions
    failure = w.status.last_failure
    assert failure is not None and failure.reason == "NodeLost"
    assert failure.pod == lost.name and "unreachable from its peers" in failure.message
    assert "node rank 0, 2" in failure.message
    d = restart(w)
    promoted = [a for a in d.actions if isinstance(a, PatchPod) and a.name == "tiny-s0"]
    assert promoted, d.actions


def test_one_neighbour_s_report_is_enough() -> None:
    w = peer_world()
    lost = w.pod_of(1).name
    w.peers_unreachable(2, [1])
    w.step()
    assert w.status.last_failure is not None and w.status.last_failure.pod == lost


def test_peers_that_cannot_reach_each_other_are_a_network_split_not_a_lost_node() -> None:
    w = peer_world(nodes=2, spares=0)
    w.peers_unreachable(0, [1])
    w.peers_unreachable(1, [0])
    w.step()
    assert w.status.phase == "Running" and w.status.restarts.total == 0


def test_a_cleared_report_is_no_fault() -> None:
    w = peer_world()
    w.peers_unreachable(0, [1])
    w.peers_unreachable(0, [])  # reached again before the operator looked
    w.step()
    w.beat(6)
    w.step()
    assert w.status.phase == "Running" and w.status.restarts.total == 0


def test_reports_are_judged_seconds_after_an_outage_of_the_api_server() -> None:
    """Not at once (a neighbour back during the outage is still reported until its launcher's
    next round), and not after the node controller's long grace either."""
    w = peer_world()
    lost = w.pod_of(1).name
    w.peers_unreachable(0, [1])
    w.seeing_since = w.now  # the operator just got the API server back
    w.step()
    assert w.status.phase == "Running"
    w.advance(PEER_SETTLE_SECONDS + 0.5)  # the launchers' rounds that clear old reports
    w.beat(6)
    w.step()
    assert w.status.phase == "Restarting"
    assert w.status.last_failure is not None and w.status.last_failure.pod == lost


def test_the_trainers_renewals_keep_the_launcher_s_report() -> None:
    """The trainer's heartbeat patches its own keys: a renewal after the report leaves it."""
    w = peer_world()
    w.peers_unreachable(0, [1])
    w.advance(timedelta(seconds=1).total_seconds())
    w.beat(6)
    w.step()
    assert w.status.phase == "Restarting"
