"""Heartbeats: each node's local rank 0 renews its pod's Lease with liveness and progress.

The protocol (Lease name, annotation keys, period) is `hlat_api.heartbeat`; the operator reads
it to detect hangs (a stale `renewTime`) and to report progress. Design choices:
- A daemon thread renews at the period with the latest values the training loop handed over,
  so a slow step never delays a beat. Every hand-over stamps `progress_time`: a frozen or dead
  process stops renewing, a loop stuck in a collective or the device runtime keeps renewing
  with an old `progress_time`, and the operator tells the two apart.
- The pod's own service-account token (in-cluster config), allowed by the job's Role to patch
  only this pod's Lease; the Lease is created by the operator.
- API errors never stop training: they are logged (once per kind of error) and retried at the
  next period.
- Off when not in a pod: no `HLAT_HEARTBEAT_LEASE`, no service-account token, or not local
  rank 0.
- Fencing: a renewal refused with 403 (the job's Role names only the current attempt's Leases)
  or 404 (the operator deleted the Lease of an ended attempt) means this trainer's attempt is
  over. `fenced` stays True; the checkpointer then commits nothing (`fenced_now` asks again
  before each commit) and the next step's report stops the trainer (`ExitCode.FENCED`).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from typing import Any

from hlat_api import Env, ExitCode, Heartbeat
from hlat_api.heartbeat import DEFAULT_PERIOD_SECONDS, EXPIRY_PERIODS

log = logging.getLogger(__name__)
TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount/token"


class LeaseHeartbeat:
    def __init__(self, api: Any, namespace: str, lease: str, holder: str, period: float,
                 attempt: int | None = None) -> None:
        self.api, self.namespace, self.lease, self.holder = api, namespace, lease, holder
        self.period = period
        self.beat = Heartbeat(attempt=attempt)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._errors: set[str] = set()
        self.fenced = False
        """A renewal was refused for good: this trainer's attempt is over."""
        self._thread = threading.Thread(target=self._loop, name="hlat-heartbeat", daemon=True)

    @classmethod
    def from_environment(cls, local_rank: int) -> LeaseHeartbeat | None:
        lease = os.environ.get(Env.HEARTBEAT_LEASE)
        if not lease or local_rank != 0 or not os.path.exists(TOKEN_PATH):
            return None
        from kubernetes import client, config

        from hlat_api.apitimeouts import bound_requests

        config.load_incluster_config()  # type: ignore[no-untyped-call]
        attempt = os.environ.get(Env.ATTEMPT)
        return cls(
            client.CoordinationV1Api(bound_requests(client.ApiClient())), os.environ.get(Env.NAMESPACE, "default"), lease,
            os.environ.get(Env.POD_NAME, lease),
            float(os.environ.get(Env.HEARTBEAT_PERIOD) or DEFAULT_PERIOD_SECONDS),
            int(attempt) if attempt else None,
        )

    def start(self) -> LeaseHeartbeat:
        self._thread.start()
        return self

    def update(self, **fields: Any) -> None:
        """Hand over the latest values (the loop moved); the thread publishes them at its next
        beat."""
        now = datetime.datetime.now(datetime.UTC)
        with self._lock:
            self.beat = self.beat.model_copy(update={**fields, "progress_time": now})

    def __call__(self, stats: dict[str, Any]) -> None:
        """A training-loop sink: one dict per step. A fenced trainer stops here."""
        if self.fenced:
            log.error("Lease %s/%s refuses this trainer's renewals: its attempt is over; "
                      "stopping", self.namespace, self.lease)
            raise SystemExit(ExitCode.FENCED)
        self.update(phase="training", step=stats["step"], tokens=stats["tokens"],
                    loss=stats["loss"], tokens_per_second=stats["tokens_per_second"],
                    step_seconds=stats["step_seconds"])

    def renew(self) -> bool:
        """Patch the Lease now; False (and a log line) on an API error."""
        with self._lock:
            beat = self.beat
        now = datetime.datetime.now(datetime.UTC)
        body = {
            "metadata": {"annotations": beat.to_annotations()},
            "spec": {"holderIdentity": self.holder, "renewTime": now.isoformat(),
                     "leaseDurationSeconds": max(1, round(self.period * EXPIRY_PERIODS))},
        }
        try:
            self.api.patch_namespaced_lease(self.lease, self.namespace, body)
        except Exception as err:  # the API server's trouble must never stop training
            if getattr(err, "status", None) in (403, 404):
                self.fenced = True
            kind = type(err).__name__ + str(getattr(err, "status", ""))
            if kind not in self._errors:
                self._errors.add(kind)
                log.warning("heartbeat to Lease %s/%s failed (%s); retrying every %.0fs",
                            self.namespace, self.lease, str(err).splitlines()[0][:200],
                            self.period)
            return False
        return True

    def fenced_now(self) -> bool:
        """Renew now and say whether this trainer's attempt is over (before a commit)."""
        if not self.fenced:
            self.renew()
        return self.fenced

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.renew()
            self._stop.wait(self.period)

    def stop(self, phase: str | None = None) -> None:
        """Stop the thread; with a phase (e.g. finished), publish it once more first."""
        self._stop.set()
        self._thread.join(timeout=self.period + 5)
        if phase is not None:
            self.update(phase=phase)
            self.renew()
