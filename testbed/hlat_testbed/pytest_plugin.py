"""pytest fixtures for the local Kubernetes control plane.

- ``cluster`` (session): the running local cluster if there is one (``hlat-cluster up`` before
  the suite makes repeated runs fast), otherwise one started for the session (building the
  binaries first on a fresh machine) and stopped at its end. ``HLAT_TEST_NODES`` sets how many
  nodes a started cluster gets (default 3); ``HLAT_KEEP_CLUSTER=1`` leaves it running.
- ``namespace`` (per test): a fresh namespace, deleted after the test; teardown waits until its
  pods are gone so the next test finds the nodes' Neuron devices free.
- ``core``: a ``CoreV1Api`` as the cluster admin.
- ``helm`` (session): the Helm CLI built from its Go module (no cluster needed).

Under pytest-xdist (``make test`` runs ``-n 2 --dist loadfile``) each worker has a cluster of its
own: worker ``gw0`` the shared one, worker ``gwN`` one in ``~/.cache/hlat/cluster-gwN`` on bridge
``hlatN``, subnet ``10.(244+N).0.0/16`` and etcd ports ``2379+10N`` (see ``worker_cluster_config``).
A test module keeps one worker for all its tests (its operator watches every ``test-*``
namespace of its cluster, so two modules must never share one).

Only tests that request these fixtures (mark them ``@pytest.mark.cluster``) start a cluster; the
unit tests never do. When such tests are collected and the binaries are not cached yet, they are
built right after collection, outside any test, so a cold build (about 10 minutes on 2 cores)
does not count against pytest-timeout's per-test limit.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from hlat_testbed import build
from hlat_testbed.cluster import Cluster
from hlat_testbed.config import ClusterConfig
from hlat_testbed.testing import wait_for

DEFAULT_TEST_NODES = 3


def _progress(line: str) -> None:
    print(f"[hlat-cluster] {line}", file=sys.stderr, flush=True)


def worker_cluster_config(worker: str) -> ClusterConfig | None:
    """The cluster of pytest-xdist worker ``worker`` (``gw3``): None for ``gw0`` (the shared
    cluster), else one that shares no state directory, bridge, subnet or port with the others."""
    index = int(worker.removeprefix("gw"))
    if index == 0:
        return None
    return ClusterConfig(name=f"hlat-gw{index}", state_dir=str(build.cache_root() / f"cluster-gw{index}"),
                         bridge=f"hlat{index}", subnet=f"10.{244 + index}.0.0/16",
                         etcd_port=2379 + 10 * index)


def pytest_configure(config: pytest.Config) -> None:
    """On an xdist worker other than the first, point ``HLAT_CLUSTER_DIR`` at the worker's own
    cluster before anything reads it (this process and the tools the tests start alike)."""
    worker = getattr(config, "workerinput", {}).get("workerid")
    own = worker_cluster_config(worker) if worker else None
    if own is None:
        return
    own.state.mkdir(parents=True, exist_ok=True)
    own.save()
    os.environ["HLAT_CLUSTER_DIR"] = own.state_dir


def pytest_collection_finish(session: pytest.Session) -> None:
    needs_build = any({"cluster", "helm", "promtool"} & set(getattr(item, "fixturenames", ()))
                      for item in session.items)
    if not needs_build or os.geteuid() != 0 or session.config.option.collectonly:
        return
    if all(c.is_built() for c in build.COMPONENTS):
        return
    capture = session.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        _progress("building the control plane's binaries (once per version; see docs/testbed.md)")
        build.ensure_built(_progress)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    if os.geteuid() != 0:
        pytest.skip("the local cluster needs root (network namespaces, bind mounts)")
    handle = Cluster()
    nodes = int(os.environ.get("HLAT_TEST_NODES", DEFAULT_TEST_NODES))
    started_here = not handle.is_up()
    handle.up(nodes=nodes, progress=_progress)
    yield handle
    if started_here and not os.environ.get("HLAT_KEEP_CLUSTER"):
        handle.down(progress=_progress)


@pytest.fixture(scope="session")
def helm() -> Path:
    """The Helm CLI built from its Go module (hlat_testbed.build.HELM), built if missing."""
    build.build_component(build.HELM, _progress)
    return build.HELM.binary("helm")


@pytest.fixture(scope="session")
def promtool() -> Path:
    """promtool, built with Prometheus from its Go module (hlat_testbed.build.PROMETHEUS)."""
    build.build_component(build.PROMETHEUS, _progress)
    return build.PROMETHEUS.binary("promtool")


@pytest.fixture
def core(cluster: Cluster) -> client.CoreV1Api:
    return client.CoreV1Api(cluster.admin_api())


def _namespace_name(test_name: str) -> str:
    stem = re.sub(r"[^a-z0-9-]+", "-", test_name.lower()).strip("-")[:40].strip("-")
    return f"{stem}-{uuid.uuid4().hex[:5]}"


@pytest.fixture
def namespace(cluster: Cluster, core: client.CoreV1Api,
              request: pytest.FixtureRequest) -> Iterator[str]:
    name = _namespace_name(request.node.name)
    core.create_namespace({"apiVersion": "v1", "kind": "Namespace",  # type: ignore[arg-type]
                           "metadata": {"name": name}})
    # as on any cluster, pods are only admitted once the controllers have populated the
    # namespace with its default service account and the root CA ConfigMap
    wait_for(lambda: core.list_namespaced_service_account(
        name, field_selector="metadata.name=default").items, 30, f"{name}/default SA")
    wait_for(lambda: core.list_namespaced_config_map(
        name, field_selector="metadata.name=kube-root-ca.crt").items, 30, f"{name} root CA")
    yield name
    # deleting the pods first is what an operator's cleanup would do, and it avoids the
    # namespace controller's back-off (it re-checks only after the pods' grace period)
    core.delete_collection_namespaced_pod(name)
    core.delete_namespace(name)
    wait_for(lambda: not core.list_namespaced_pod(name).items, 90,
             f"pods of namespace {name} to be gone")
