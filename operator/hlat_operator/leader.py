"""Leader election on a coordination.k8s.io Lease: of several operator replicas, one acts.

The scheme is client-go's (`leaderelection`), which kube-scheduler and kube-controller-manager
use: the leader renews the Lease's `renewTime` every `retry` seconds; a candidate takes the Lease
over only after it has seen the same record unchanged for `lease_seconds` *by its own clock*
(never by comparing the leader's timestamps with its own clock, so clock skew between nodes
cannot shorten a lease). Writes carry the resourceVersion read, so of two candidates racing for
an expired Lease exactly one wins (the other gets 409).

Fencing: a leader that has not renewed for `renew_deadline` seconds (< lease_seconds) stops
acting at once (`on_lost`; the CLI exits, its Deployment restarts it as a candidate), before any
candidate can have taken over. Beyond that the operator's own writes are guarded: status patches
carry the resourceVersion they were decided on, so a pass decided by a deposed leader loses.

`decide` is pure (record, what this candidate saw and when, now) -> what to do; `Elector` does
the I/O with the kubernetes client and runs the renewal thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from urllib3.exceptions import HTTPError

log = logging.getLogger(__name__)

Verdict = Literal["create", "renew", "take", "wait"]


@dataclass(frozen=True)
class Record:
    """What the Lease says: who holds it, and its renewal counter (resourceVersion)."""

    holder: str | None
    version: str | None
    renew_time: str | None


def decide(record: Record | None, seen: Record | None, seen_at: float, now: float, me: str,
           lease_seconds: float) -> Verdict:
    """The next step of candidate `me` (pure; `now` and `seen_at` are its monotonic clock).

    `seen` is the record this candidate last observed and `seen_at` when it first saw it."""
    if record is None:
        return "create"
    if record.holder == me:
        return "renew"
    if not record.holder:
        return "take"  # released by its holder
    unchanged = seen is not None and seen.version == record.version
    if unchanged and now - seen_at >= lease_seconds:
        return "take"
    return "wait"


def _micro_now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Elector:
    """One candidate for the Lease `namespace/name`."""

    def __init__(self, api: client.ApiClient, namespace: str, name: str, identity: str,
                 lease_seconds: float = 15.0, renew_deadline: float = 10.0,
                 retry_seconds: float = 2.0) -> None:
        if not retry_seconds < renew_deadline < lease_seconds:
            raise ValueError("leader election needs retry < renew deadline < lease duration")
        self.api = client.CoordinationV1Api(api)
        self.namespace, self.name, self.identity = namespace, name, identity
        self.lease_seconds, self.renew_deadline = lease_seconds, renew_deadline
        self.retry_seconds = retry_seconds
        self._seen: Record | None = None
        self._seen_at = 0.0
        self.stopped = threading.Event()

    # --- one attempt ---------------------------------------------------------------------------
    def _read(self) -> tuple[Record | None, Any]:
        try:
            lease: Any = self.api.read_namespaced_lease(self.name, self.namespace)
        except ApiException as err:
            if err.status == 404:
                return None, None
            raise
        spec = lease.spec
        renew = spec.renew_time.isoformat() if spec and spec.renew_time else None
        return Record(spec.holder_identity if spec else None, lease.metadata.resource_version,
                      renew), lease

    def _body(self, version: str | None, transitions: int) -> dict[str, Any]:
        meta: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if version:
            meta["resourceVersion"] = version
        stamp = _micro_now()
        return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
                "spec": {"holderIdentity": self.identity,
                         "leaseDurationSeconds": max(1, round(self.lease_seconds)),
                         "renewTime": stamp, "acquireTime": stamp,
                         "leaseTransitions": transitions}}

    def try_once(self) -> bool:
        """Acquire or renew; True when this candidate holds the Lease afterwards."""
        now = time.monotonic()
        try:
            record, lease = self._read()
            if record != self._seen:
                self._seen, self._seen_at = record, now
            verdict = decide(record, self._seen, self._seen_at, now, self.identity,
                             self.lease_seconds)
            if verdict == "wait":
                return False
            if verdict == "create":
                self.api.create_namespaced_lease(self.namespace, self._body(None, 0))  # type: ignore[arg-type]
            else:
                transitions = (lease.spec.lease_transitions or 0) + (verdict == "take")
                body = self._body(record.version if record else None, transitions)
                if verdict == "renew":
                    body["spec"]["acquireTime"] = lease.spec.acquire_time.isoformat() \
                        if lease.spec.acquire_time else body["spec"]["acquireTime"]
                self.api.replace_namespaced_lease(self.name, self.namespace, body)  # type: ignore[arg-type]
        except ApiException as err:
            if err.status in (404, 409):
                return False  # another candidate moved first: look again
            log.warning("leader election on %s/%s: %s", self.namespace, self.name, err.reason)
            return False
        except (HTTPError, OSError) as err:
            log.warning("leader election on %s/%s: %s", self.namespace, self.name, err)
            return False
        if verdict != "renew":
            log.info("%s is now the leader (%s/%s)", self.identity, self.namespace, self.name)
        return True

    # --- loops ----------------------------------------------------------------------------------
    def acquire(self, timeout: float | None = None) -> bool:
        """Block until this candidate leads (True), or `timeout` passes / stop() (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.stopped.is_set():
            if self.try_once():
                return True
            if deadline is not None and time.monotonic() >= deadline:
                return False
            self.stopped.wait(self.retry_seconds)
        return False

    def keep(self, on_lost: Callable[[], None]) -> threading.Thread:
        """Renew in a daemon thread; call `on_lost` once renewal has failed for renew_deadline."""
        def loop() -> None:
            last = time.monotonic()
            while not self.stopped.wait(self.retry_seconds):
                if self.try_once():
                    last = time.monotonic()
                elif time.monotonic() - last >= self.renew_deadline:
                    log.error("%s lost the lease %s/%s (no renewal for %.0fs): stopping",
                              self.identity, self.namespace, self.name, self.renew_deadline)
                    on_lost()
                    return
        thread = threading.Thread(target=loop, name="leader-election", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self.stopped.set()
