"""Fixtures of the operator's end-to-end tests (the local cluster's come from hlat_testbed).

A module may set `OPERATOR_ENV` (HLAT_OPERATOR_* settings) for the operator it runs.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2e_env import Env
from e2e_network import labelled_network
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hlat_testbed.cluster import Cluster
from hlat_testbed.demo import OperatorProcess, install_crd, venv_bin
from hlat_testbed.prometheus import free_port


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Iterator[None]:
    """Keeps each phase's report on the test item (`rep_call`), for the fixtures' teardown."""
    outcome = yield
    report = outcome.get_result()
    setattr(item, f"rep_{report.when}", report)


# --- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def crd(cluster: Cluster) -> None:
    install_crd(cluster.admin_api())


@pytest.fixture(scope="module")
def sample_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sample") / "sample"
    subprocess.run([str(venv_bin("hlat-data")), "sample", "--out", str(out), "--docs", "300"],
                   check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def operator(cluster: Cluster, crd: None, tmp_path_factory: pytest.TempPathFactory,
             request: pytest.FixtureRequest) -> Iterator[dict[str, OperatorProcess]]:
    """The module's operator, in a holder so a test can replace it (kill + start again)."""
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    extra = getattr(request.module, "OPERATOR_ENV", None)  # a module's operator settings
    # a module that reads the operator's own metrics (OPERATOR_METRICS = True) gets a port
    port = free_port() if getattr(request.module, "OPERATOR_METRICS", False) else 0
    holder = {"op": OperatorProcess(cluster, log, ["test-*"], extra, metrics_port=port).start()}
    yield holder
    holder["op"].stop()
    print(f"operator log: {log}")


@pytest.fixture
def job_env(cluster: Cluster, namespace: str, sample_data: Path, tmp_path: Path,
            operator: dict[str, OperatorProcess], request: pytest.FixtureRequest
            ) -> Iterator[Env]:
    fsx = tmp_path / "fsx"
    shutil.copytree(sample_data, fsx / "data" / "sample")
    cluster.create_shared_volume(namespace, "fsx", fsx)
    env = Env(cluster, namespace, fsx, operator)
    yield env
    call = getattr(request.node, "rep_call", None)
    if call is not None and call.failed:  # what CI's output then shows of the job
        print(f"job diagnosis:\n{env.diagnosis()}")
    env.delete()
    with contextlib.suppress(ApiException):
        client.CoreV1Api(cluster.admin_api()).delete_persistent_volume(f"{namespace}-fsx")


@pytest.fixture(scope="module")
def network(cluster: Cluster) -> Iterator[dict[str, str]]:
    """Node -> its layer-3 block, on five nodes (the session's three and two more): e2e_network."""
    with labelled_network(cluster) as blocks:
        yield blocks
