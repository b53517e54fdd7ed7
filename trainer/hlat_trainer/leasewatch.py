"""Watching one Lease by name, for as long as a process wants it: the launcher's restart record
(`agent.LeaseControl`) and a trainer's own heartbeat Lease, where the operator asks for a
checkpoint (`heartbeat.LeaseHeartbeat.watch_requests`).

A watch with a `metadata.name` field selector, which a Role's `resourceNames` authorize (no
`list` on every Lease of the namespace). Each request is held by the API server for
`WATCH_SECONDS` and then made again; an error (the API server away, the watch refused by a
Role without `watch`: an operator of an earlier version) is handed to `failed` and the watch
tried again after `retry_seconds`, or `REFUSED_RETRY_SECONDS` after a 403. The caller keeps its
own slower path meanwhile (a poll, or the heartbeat's renewals), so a watch that is down only
costs latency.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

WATCH_SECONDS = 60
"""Server-side timeout of one watch request (then the Lease is watched again)."""
CONNECT_SECONDS = 5.0
REFUSED_RETRY_SECONDS = 30.0
"""A watch refused (403) is tried again this much later."""


def watch_lease(api: Any, namespace: str, name: str, seen: Callable[[Any], None],
                failed: Callable[[Exception], None], stopped: threading.Event,
                retry_seconds: float) -> None:
    """Call `seen` with the Lease object at each ADDED or MODIFIED event until `stopped` is
    set (a request in flight ends by its own timeout, or at its next event); `api` is a
    CoordinationV1Api."""
    from kubernetes import watch

    while not stopped.is_set():
        try:
            events = watch.Watch().stream(  # type: ignore[no-untyped-call]
                api.list_namespaced_lease, namespace, field_selector=f"metadata.name={name}",
                timeout_seconds=WATCH_SECONDS,
                _request_timeout=(CONNECT_SECONDS, WATCH_SECONDS + 15))
            for event in events:
                if stopped.is_set():
                    return
                if event["type"] in ("ADDED", "MODIFIED"):
                    seen(event["object"])
        except Exception as err:  # refused, or the API server away: tried again
            if stopped.is_set():
                return
            failed(err)
            # refused: a Role without `watch`, or an API server just restarted whose
            # authorizer has not loaded the Roles yet (a moment)
            refused = getattr(err, "status", None) == 403
            stopped.wait(REFUSED_RETRY_SECONDS if refused else retry_seconds)
