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
- Fencing: renewals refused with 403 (the job's Role names only the current attempt's Leases)
  or 404 (the operator deleted the Lease of an ended attempt) mean this trainer's attempt is
  over, once they have been refused for `REFUSAL_CONFIRM_SECONDS` with none accepted: an API
  server that has just restarted refuses a request or two before its authorizer has loaded the
  Roles (measured on the rig: one 403 among thousands of requests across a restart), and that
  must not stop a healthy trainer. While refused, renewals are retried every
  `REFUSED_RETRY_SECONDS`. `fenced` then stays True; the checkpointer commits nothing
  (`fenced_now` asks again, and waits out a refusal, before each commit) and the next step's
  report stops the trainer (`ExitCode.FENCED`). A trainer whose renewals have not been
  accepted for longer than the Lease's duration (cut off from the API server) commits no
  checkpoint either until one is accepted again, but trains on: it may be the live one. The
  run's last checkpoint has no later one to commit instead: rank 0 waits, bounded, for a
  renewal to be accepted and commits it then (train.py, `_commit_withheld`).
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
import time
from typing import Any

from hlat_api import Env, ExitCode, Heartbeat
from hlat_api.heartbeat import (
    CHECKPOINT_REQUEST,
    DEFAULT_PERIOD_SECONDS,
    EXPIRY_PERIODS,
    STARTING_PHASES,
)
from hlat_trainer.errors import first_line
from hlat_trainer.leasewatch import watch_lease

log = logging.getLogger(__name__)
TOKEN_PATH = "/var/run/secrets/kubernetes.io/serviceaccount/token"
REFUSAL_CONFIRM_SECONDS = 3.0
"""Renewals refused (403/404) for this long, none accepted in between: the attempt is over."""
REFUSED_RETRY_SECONDS = 0.5
"""How often a refused renewal is tried again until it is accepted or confirmed."""


class LeaseHeartbeat:
    def __init__(self, api: Any, namespace: str, lease: str, holder: str, period: float,
                 attempt: int | None = None) -> None:
        self.api, self.namespace, self.lease, self.holder = api, namespace, lease, holder
        self.period = period
        self.beat = Heartbeat(attempt=attempt)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        """Set to renew before the period ends: the attempt's start is over (see `update`)."""
        self._errors: set[str] = set()
        self._refused_since: float | None = None
        self._accepted_at = time.monotonic()
        """When a renewal was last accepted (at first: the operator has just created this
        attempt's Lease and started it)."""
        self.fenced = False
        """A renewal was refused for good: this trainer's attempt is over."""
        self.checkpoint_request = 0
        """The newest checkpoint the operator asked for on this Lease (`CHECKPOINT_REQUEST`),
        read from the renewals' answers; 0: none."""
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

    def watch_requests(self) -> LeaseHeartbeat:
        """Watch this Lease for the operator's checkpoint request on a daemon thread of its
        own (`hlat_trainer.leasewatch`), so that it is seen when written, not at the next
        renewal a period later (10 s on EKS: a preempted or suspended job held its quota and
        nodes that much longer). The renewals' answers still carry it, should the watch be
        down or refused (a Role without `watch`). Ends with `stop`."""
        def failed(err: Exception) -> None:
            kind = "watch" + type(err).__name__ + str(getattr(err, "status", ""))
            if kind not in self._errors:
                self._errors.add(kind)
                log.warning("watching Lease %s/%s failed (%s); its renewals still carry the "
                            "operator's requests", self.namespace, self.lease,
                            first_line(err, 200))

        threading.Thread(target=watch_lease, name="hlat-request-watch", daemon=True,
                         args=(self.api, self.namespace, self.lease, self._read_request,
                               failed, self._stop, self.period)).start()
        return self

    def update(self, **fields: Any) -> None:
        """Hand over the latest values (the loop moved); the thread publishes them at its next
        beat, or at once when the worker leaves its start (starting or compiling): the
        operator's Ready, its recovery time and its spares' release wait for that news, which
        a period (10 s by default) would otherwise hold back."""
        now = datetime.datetime.now(datetime.UTC)
        with self._lock:
            before = self.beat.phase
            self.beat = self.beat.model_copy(update={**fields, "progress_time": now})
            started = before in STARTING_PHASES and self.beat.phase not in STARTING_PHASES
        if started:
            self._wake.set()

    def renew_soon(self) -> None:
        """Publish at once, not at the next period (a checkpoint the operator waits for is
        complete: its pods stop, and the job holding the quota starts, that much sooner)."""
        self._wake.set()

    def __call__(self, stats: dict[str, Any]) -> None:
        """A training-loop sink: one dict per step. A fenced trainer stops here."""
        if self.fenced:
            log.error("Lease %s/%s refuses this trainer's renewals: its attempt is over; "
                      "stopping", self.namespace, self.lease)
            raise SystemExit(ExitCode.FENCED)
        self.update(phase="training", step=stats["step"], tokens=stats["tokens"],
                    loss=stats["loss"], tokens_per_second=stats["tokens_per_second"],
                    step_seconds=stats["step_seconds"],
                    compute_seconds=stats.get("compute_seconds"),
                    sync_seconds=stats.get("sync_seconds"),
                    data_wait_seconds=stats.get("data_wait_median_seconds"),
                    host_seconds=stats.get("host_seconds"))

    def renew(self) -> bool:
        """Patch the Lease now; False (and a log line) on an API error."""
        with self._lock:
            beat = self.beat
        now = datetime.datetime.now(datetime.UTC)
        body = {
            "metadata": {"annotations": beat.to_annotations()},
            "spec": {"holderIdentity": self.holder, "renewTime": now.isoformat(),
                     "leaseDurationSeconds": self.lease_seconds},
        }
        try:
            answer = self.api.patch_namespaced_lease(self.lease, self.namespace, body)
        except Exception as err:  # the API server's trouble must never stop training
            if getattr(err, "status", None) in (403, 404):
                self._refused()
            kind = type(err).__name__ + str(getattr(err, "status", ""))
            if kind not in self._errors:
                self._errors.add(kind)
                log.warning("heartbeat to Lease %s/%s failed (%s); retrying every %.1fs",
                            self.namespace, self.lease, first_line(err, 200), self._wait())
            return False
        with self._lock:
            self._refused_since = None
            self._accepted_at = time.monotonic()
        self._read_request(answer)
        return True

    def _read_request(self, lease: Any) -> None:
        """The operator's checkpoint request on the Lease as the renewal left it (the patch
        answers with the whole object); a value that is not a positive integer is ignored,
        and said once."""
        annotations = getattr(getattr(lease, "metadata", None), "annotations", None) or {}
        raw = annotations.get(CHECKPOINT_REQUEST)
        if raw is None:
            return
        try:
            value = int(raw)
        except ValueError:
            value = 0
        if value <= 0:
            if "request" not in self._errors:
                self._errors.add("request")
                log.warning("Lease %s/%s: %s=%r is not a positive integer; ignored",
                            self.namespace, self.lease, CHECKPOINT_REQUEST, raw)
            return
        with self._lock:  # the renewals' thread and the watch's
            if value <= self.checkpoint_request:
                return
            self.checkpoint_request = value
        log.info("Lease %s/%s: the operator asks for a checkpoint now (request %d)",
                 self.namespace, self.lease, value)

    def _refused(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self._refused_since is None:
                self._refused_since = now
            if now - self._refused_since >= REFUSAL_CONFIRM_SECONDS and not self.fenced:
                self.fenced = True
                log.error("Lease %s/%s has refused renewals for %.1fs: this attempt is over",
                          self.namespace, self.lease, now - self._refused_since)

    def _wait(self) -> float:
        """Seconds to the next renewal: the period, or sooner while refused and unconfirmed."""
        refused = self._refused_since is not None and not self.fenced
        return min(self.period, REFUSED_RETRY_SECONDS) if refused else self.period

    @property
    def lease_seconds(self) -> int:
        """The Lease's duration: not renewed for this long, its holder counts as gone."""
        return max(1, round(self.period * EXPIRY_PERIODS))

    def fenced_now(self) -> bool:
        """Renew now and say whether this trainer may not commit a checkpoint: its attempt is
        over, or it cannot show that it is not. A refusal is retried until accepted or
        confirmed (`REFUSAL_CONFIRM_SECONDS` at most); one still unsettled then (other errors in
        between) counts as over. And no renewal accepted for longer than the Lease's duration
        (a node cut off from the API server but not from the checkpoint storage): the operator
        may already have declared this trainer gone and started another attempt, whose
        checkpoints this one must not race; this commit is skipped, training goes on, and a
        later one commits once a renewal is accepted again (an outage of the API server alone
        costs the checkpoints taken during it, never a restart)."""
        if self.fenced:
            return True
        deadline = time.monotonic() + REFUSAL_CONFIRM_SECONDS + 1
        while not self.renew() and self._refused_since is not None and not self.fenced:
            if time.monotonic() >= deadline:
                return True
            time.sleep(REFUSED_RETRY_SECONDS)
        if self.fenced:
            return True
        silent = time.monotonic() - self._accepted_at
        if silent > self.lease_seconds:
            log.warning("Lease %s/%s: no renewal accepted for %.0fs (its duration is %ds): "
                        "another attempt may hold this rank now; not committing", self.namespace,
                        self.lease, silent, self.lease_seconds)
            return True
        return False

    def fenced_lately(self) -> bool:
        """`fenced_now`'s answer from the renewals so far, with no request of its own (for what
        the loop does every step: an in-memory snapshot; a renewal each would be a write a
        step): refused for good, or no renewal accepted for longer than the Lease's duration."""
        with self._lock:
            silent = time.monotonic() - self._accepted_at
        return self.fenced or silent > self.lease_seconds

    def _loop(self) -> None:
        """Renew every period, counted from one renewal's start to the next's: a slow API call
        does not stretch the cadence (three late renewals in a row would let the Lease expire
        while the process is alive)."""
        while not self._stop.is_set():
            began = time.monotonic()
            self.renew()
            self._wake.wait(max(0.0, began + self._wait() - time.monotonic()))
            self._wake.clear()

    def stop(self, phase: str | None = None) -> None:
        """Stop the thread; with a phase (e.g. finished), publish it once more first."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=self.period + 5)
        if phase is not None:
            self.update(phase=phase)
            self.renew()
