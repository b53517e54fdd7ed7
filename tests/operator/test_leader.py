"""Leader election: one acting operator among replicas; a standby takes over only after the
leader's Lease went unrenewed for the lease duration, by the standby's own clock."""

from __future__ import annotations

import threading
import time
import uuid

import pytest
from kubernetes import client

from hlat_operator.leader import Elector, Record, decide
from hlat_testbed.cluster import Cluster

HELD = Record("a", "7", "2025-01-01T00:00:00Z")


@pytest.mark.parametrize(("record", "seen", "seen_at", "now", "verdict"), [
    (None, None, 0, 0, "create"),
    (HELD, HELD, 0, 100, "take"),                       # held by "a", unchanged for 100 s
    (Record("b", "7", None), None, 0, 0, "renew"),      # ours
    (HELD, HELD, 10, 24.9, "wait"),                     # seen unchanged for 14.9 s < 15
    (HELD, HELD, 10, 25, "take"),                       # 15 s
    (HELD, Record("a", "6", None), 0, 100, "wait"),     # it moved since: a live leader
    (Record("", "7", None), None, 0, 0, "take"),        # released
])
def test_decide(record: Record | None, seen: Record | None, seen_at: float, now: float,
                verdict: str) -> None:
    assert decide(record, seen, seen_at, now, "b", 15.0) == verdict


def test_the_timings_must_nest() -> None:
    with pytest.raises(ValueError, match="retry < renew deadline < lease"):
        Elector(client.ApiClient(), "ns", "x", "me", lease_seconds=5, renew_deadline=6)


@pytest.mark.cluster
@pytest.mark.slow
def test_one_leader_and_a_takeover_after_the_lease(cluster: Cluster, namespace: str) -> None:
    name = f"leader-{uuid.uuid4().hex[:5]}"
    timing = {"lease_seconds": 3.0, "renew_deadline": 2.0, "retry_seconds": 0.5}
    a = Elector(cluster.admin_api(), namespace, name, "a", **timing)
    b = Elector(cluster.admin_api(), namespace, name, "b", **timing)
    assert a.acquire(timeout=10)
    lost = threading.Event()
    a.keep(on_lost=lost.set)
    assert not b.acquire(timeout=6)  # two lease durations: a renews, b never takes over
    a.stop()  # the leader dies (no more renewals)
    started = time.monotonic()
    assert b.acquire(timeout=15)
    took = time.monotonic() - started
    assert 3.0 - 0.6 <= took <= 3.0 + 2.5, took  # the lease, as b's clock saw it, + a retry
    lease = client.CoordinationV1Api(cluster.admin_api()).read_namespaced_lease(name, namespace)
    assert lease.spec.holder_identity == "b" and lease.spec.lease_transitions == 1


@pytest.mark.cluster
@pytest.mark.slow
def test_a_leader_that_cannot_renew_steps_down_before_anyone_takes_over(
        cluster: Cluster, namespace: str) -> None:
    name = f"leader-{uuid.uuid4().hex[:5]}"
    timing = {"lease_seconds": 4.0, "renew_deadline": 2.0, "retry_seconds": 0.5}
    a = Elector(cluster.admin_api(), namespace, name, "a", **timing)
    b = Elector(cluster.admin_api(), namespace, name, "b", **timing)
    assert a.acquire(timeout=10)
    b.try_once()  # b starts watching the record
    unreachable = client.Configuration()
    unreachable.host = "https://127.0.0.1:1"  # a is cut off from the API server
    unreachable.retries = 0
    a.api = client.CoordinationV1Api(client.ApiClient(unreachable))
    lost_at: list[float] = []
    a.keep(on_lost=lambda: lost_at.append(time.monotonic()))
    start = time.monotonic()
    assert b.acquire(timeout=15)
    taken_at = time.monotonic()
    assert lost_at and lost_at[0] < taken_at, (lost_at, taken_at - start)
    a.stop()
