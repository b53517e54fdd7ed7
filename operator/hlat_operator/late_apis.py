"""Start the watches kopf misses after the operator started: of an API the API server began to
serve later (Kueue installed after the operator, as HyperPod's task-governance add-on may be), and
of a namespace matching `--namespace` created in a gap of kopf's namespace watch.

kopf (1.45.2) starts such a watch only when an event of a CRD in the API's group reaches it
after the API server's discovery lists the resource: `kopf/_core/reactor/observation.py`,
`process_discovered_resource_event`, rescans the group once per CRD event. The API server lists
a custom resource once its discovery controller has synced the Established CRD
(k8s.io/apiextensions-apiserver `pkg/apiserver/customresource_discovery_controller.go`, `sync`
skips CRDs not Established), and that sync runs on its own queue: the CRD's last event (the
`Established` condition) can reach kopf before it. Then no later CRD event comes, and kopf never
watches the resource. Without the right to watch CRDs kopf scans once, at start, and never
again. Either way, a job heard of Kueue's writes only at its next resync (`MAX_IDLE_SECONDS`).

So, while a resource the handlers name is not watched, `follow` reads the group's discovery every
`PERIOD` seconds and, once the API server lists the resource, has kopf rescan the group: the
call a CRD event makes.

Namespaces: kopf (1.45.2, `observation.namespace_observer`) lists the namespaces once, then starts
its watcher, which lists them again and watches from that second list's resource version; but
`process_discovered_namespace_event` drops the second list's items (type None). So a namespace
created between the two lists, or while a watch was re-listing after it expired (410 Gone), is
never served: its jobs get no status at all (a CI run: a test's namespace created as the operator
started, `status: {}` for 120 s). `follow_namespaces` lists them every `PERIOD` seconds and
revises kopf's record as its own events would.

Private kopf API, pinned by uv.lock; if it moved, `follow` and `follow_namespaces` say so once
and stop: the resync still serves the jobs of the APIs, and the namespaces kopf saw are served.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Collection
from typing import Any

log = logging.getLogger("hlat_operator")

PERIOD = 10.0
"""Seconds between two reads of discovery while a resource is not watched."""
KOPF_MOVED = ("cannot follow APIs served after start (%s): a resource installed later is heard "
              "of at each job's resync until the operator restarts")
KOPF_MOVED_NS = ("cannot follow namespaces created after start (%s): one kopf's watch missed is "
                 "served only after the operator restarts")


def insights() -> Any:
    """A fresh kopf Insights to pass to kopf.run, or None if kopf moved it (then nothing is
    followed)."""
    try:
        from kopf._cogs.structs.references import Insights
    except ImportError as err:
        log.warning(KOPF_MOVED, err)
        return None
    return Insights()


def watched(insights: Any, group: str, plural: str) -> bool:
    return any(r.group == group and r.plural == plural for r in insights.watched_resources)


async def follow(insights: Any, settings: Any, registry: Any,
                 wanted: Collection[tuple[str, str]], period: float = PERIOD) -> None:
    """Until kopf watches every (group, plural) in `wanted`: read discovery every `period`
    seconds, and rescan a group whose resource is listed but not watched."""
    import aiohttp
    try:
        from kopf._cogs.clients import errors, scanning
        from kopf._core.reactor import observation
    except ImportError as err:  # kopf moved its internals: the resync alone serves the jobs
        log.warning(KOPF_MOVED, err)
        return
    await insights.ready_resources.wait()  # kopf's own scan at start goes first
    pending = {w for w in wanted if not watched(insights, *w)}
    if pending:
        log.info("not served at start, followed every %.0fs: %s", period,
                 ", ".join(f"{plural}.{group}" for group, plural in sorted(pending)))
    while pending:
        await asyncio.sleep(period)
        for group, plural in sorted(pending):
            if watched(insights, group, plural):  # kopf's CRD event won the race
                pending.discard((group, plural))
                continue
            try:
                listed = await scanning.scan_resources(groups={group}, settings=settings,
                                                       logger=log)
                if not any(r.plural == plural for r in listed):
                    continue
                await observation.process_discovered_resource_event(
                    raw_event={"type": "MODIFIED", "object": {"spec": {"group": group}}},
                    settings=settings, registry=registry, insights=insights)
            except (errors.APIError, aiohttp.ClientError, TimeoutError) as err:  # next period
                log.warning("reading the discovery of %s: %s", group, err)
                continue
            if watched(insights, group, plural):
                log.info("%s.%s is served now: watching it", plural, group)
                pending.discard((group, plural))


async def follow_namespaces(insights: Any, settings: Any, patterns: Collection[str],
                            period: float = PERIOD) -> None:
    """Every `period` seconds, list the namespaces and have kopf serve those matching
    `patterns` it does not, as its namespace events would; for an operator watching the
    namespaces `patterns` (globs allowed), not the whole cluster."""
    import aiohttp
    try:
        from kopf._cogs.clients import errors, fetching
        from kopf._cogs.structs import references
        from kopf._core.reactor import observation
    except ImportError as err:
        log.warning(KOPF_MOVED_NS, err)
        return
    await insights.ready_namespaces.wait()  # kopf's own listing at start goes first
    resource = await insights.backbone.wait_for(references.NAMESPACES)
    while True:
        await asyncio.sleep(period)
        try:
            listed = [obj async for chunk, _ in fetching.fetch_objs(
                settings=settings, resource=resource, namespace=None, logger=log)
                for obj in chunk]
        except errors.APIForbiddenError as err:  # kopf then serves the names as given
            log.warning(KOPF_MOVED_NS, f"not allowed to list namespaces: {err}")
            return
        except (errors.APIError, aiohttp.ClientError, TimeoutError) as err:  # next period
            log.warning("listing the namespaces: %s", err)
            continue
        async with insights.revised:
            before = set(insights.namespaces)
            # adds only (and drops the terminating, as kopf does): a namespace kopf's watch
            # added after this listing must not be taken away by it
            observation.revise_namespaces(raw_bodies=listed, insights=insights,
                                          namespaces=list(patterns))
            if insights.namespaces != before:
                log.info("namespaces kopf's watch missed, now %s: %s",
                         "served" if insights.namespaces > before else "revised",
                         ", ".join(sorted(insights.namespaces ^ before)))
                insights.revised.notify_all()
