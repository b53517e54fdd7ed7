"""Every node of the cluster, kept current by one list and then a watch (a reflector).

Each pass of each job needs the nodes its pods sit on (lost, not Ready, cordoned). Listing every
node per pass was most of the operator's work at 500 jobs (bench_operator_scale: a third of its
CPU in that list and its JSON); a node changes rarely (kubelets heartbeat through Leases, and
write the Node only when its status changes), so one watch stream serves every pass.

The thread lists the nodes, then watches from the list's resourceVersion (with bookmarks), and
watches again from the last version seen when the server ends a watch. Any failure (connection
lost, the API server's `410 Gone` for a version too old) marks the view unsynced until a new
list succeeds: meanwhile `snapshot()` is None and `Kube.nodes` lists per pass as before, so a
broken watch never serves an old view. Every request has a bound (`bound_requests` for the
list; the watch asks the server to end it after `WATCH_SECONDS` and reads with a longer bound).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from typing import Any

from hlat_api.errors import first_line

log = logging.getLogger(__name__)

WATCH_SECONDS = 240
"""The server ends each watch after this long; it is then resumed from the last version."""
READ_SECONDS = WATCH_SECONDS + 30.0
"""Longest silence on the stream before it is taken as dropped (bookmarks arrive ~1/min)."""
RETRY_SECONDS = 2.0
"""Wait before listing again after a failure (doubling up to `MAX_RETRY_SECONDS`)."""
MAX_RETRY_SECONDS = 30.0


class Resync(Exception):
    """The watch cannot go on from its version: list again."""


def _name(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


def _version(obj: Mapping[str, Any]) -> str:
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


class NodeWatch:
    """`core`: a kubernetes CoreV1Api. `start()` runs the reflector on a daemon thread."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self._items: dict[str, Mapping[str, Any]] = {}
        self._synced = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lists = 0
        """Lists made (the first, then one after each failure): for tests and the log."""

    def start(self) -> NodeWatch:
        self._thread = threading.Thread(target=self._run, name="node-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def snapshot(self) -> list[Mapping[str, Any]] | None:
        """Every node as last seen; None while the view is not in sync with the server."""
        with self._lock:
            return list(self._items.values()) if self._synced else None

    # --- the reflector -------------------------------------------------------------------
    def _run(self) -> None:
        failures = 0
        while not self._stop.is_set():
            try:
                version = self._list()
                failures = 0
                while not self._stop.is_set():
                    version = self._watch(version)
            except Resync as why:
                log.info("node watch: %s; listing the nodes again", why)
            except Exception as err:  # any failure: unsynced until a list succeeds again
                failures += 1
                log.warning("node watch: %s; passes list the nodes until it is back",
                            first_line(err, 300))
            with self._lock:
                self._synced = False
            self._stop.wait(min(MAX_RETRY_SECONDS, RETRY_SECONDS * 2 ** max(0, failures - 1))
                            if failures else 0.0)

    def _list(self) -> str:
        resp = self.core.list_node(_preload_content=False)
        body = json.loads(resp.data)
        items = {_name(item): item for item in body.get("items") or []}
        with self._lock:
            self._items, self._synced = items, True
        self.lists += 1
        return _version(body)

    def _watch(self, version: str) -> str:
        """One watch from `version` until the server ends it; returns the last version."""
        resp = self.core.list_node(
            watch=True, resource_version=version, allow_watch_bookmarks=True,
            timeout_seconds=WATCH_SECONDS, _preload_content=False,
            _request_timeout=(5.0, READ_SECONDS))
        try:
            for line in resp:
                if self._stop.is_set():
                    break
                if not line.strip():
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":  # 410 Gone: the version is too old to resume from
                    raise Resync(str(obj.get("message") or obj))
                version = _version(obj) or version
                if kind == "BOOKMARK":
                    continue
                with self._lock:
                    if kind == "DELETED":
                        self._items.pop(_name(obj), None)
                    else:
                        self._items[_name(obj)] = obj
        finally:
            resp.release_conn()
        return version
