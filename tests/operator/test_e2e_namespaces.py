"""An operator watching namespaces by glob (`--namespace 'team-*'`) serves a matching namespace
created after its start even where kopf's own namespace watch missed it (late_apis: kopf 1.45.2
drops the items of the listing its watcher starts from, so a namespace created between its two
listings at start, or during a re-list, is never served: a CI run's job got no status for
120 s). Here kopf's record is as after that miss: it served the namespaces that existed, and
not the one created since."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from e2e_env import kopf_logged_in
from kubernetes import client

from hlat_operator import late_apis
from hlat_testbed.cluster import Cluster

pytestmark = [pytest.mark.cluster]


def test_a_namespace_kopf_s_watch_missed_is_served_and_one_not_matching_is_not(
        cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBECONFIG", str(cluster.kubeconfig))
    tag = uuid.uuid4().hex[:6]
    missed, other = f"late-{tag}", f"other-{tag}"
    core = client.CoreV1Api(cluster.admin_api())

    async def follow() -> Any:
        from kopf._cogs.clients import scanning
        from kopf._cogs.structs import references

        settings = await kopf_logged_in()
        insights = late_apis.insights()
        # kopf's scan at its start: the backbone (where the namespaces are listed), and the
        # namespaces listing done, which missed `missed`
        await insights.backbone.fill(resources=await scanning.scan_resources(
            groups={""}, settings=settings, logger=late_apis.log))
        assert references.NAMESPACES in insights.backbone
        insights.ready_namespaces.set()
        for name in (missed, other):
            core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
        task = asyncio.create_task(late_apis.follow_namespaces(
            insights, settings, ["late-*"], period=0.2))
        try:
            async with insights.revised:
                await asyncio.wait_for(insights.revised.wait_for(
                    lambda: missed in insights.namespaces), 30)
        finally:
            task.cancel()
        return insights

    try:
        insights = asyncio.run(follow())
    finally:
        for name in (missed, other):
            core.delete_namespace(name)
    assert missed in insights.namespaces and other not in insights.namespaces
