"""The API server is the real one: CEL validation, RBAC, and pods using their projected tokens."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hlat_testbed.cluster import Cluster
from hlat_testbed.testing import python_pod, wait_for, wait_pod_phase

pytestmark = pytest.mark.cluster

GROUP = "testbed.hlat.dev"


@pytest.fixture
def widget_crd(cluster: Cluster) -> Iterator[str]:
    """A namespaced CRD whose schema has a CEL rule; yields its plural name."""
    plural = f"widgets{uuid.uuid4().hex[:6]}"
    ext = client.ApiextensionsV1Api(cluster.admin_api())
    schema = {"type": "object", "properties": {"spec": {
        "type": "object",
        "properties": {"nodes": {"type": "integer"}, "tp": {"type": "integer"}},
        "x-kubernetes-validations": [{"rule": "self.nodes * 32 % self.tp == 0",
                                      "message": "tp must divide the job's neuron cores"}],
    }}}
    ext.create_custom_resource_definition({  # type: ignore[arg-type]
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {"group": GROUP, "scope": "Namespaced",
                 "names": {"plural": plural, "singular": plural[:-1], "kind": f"W{plural}"},
                 "versions": [{"name": "v1", "served": True, "storage": True,
                               "schema": {"openAPIV3Schema": schema}}]},
    })
    wait_for(lambda: _established(ext, f"{plural}.{GROUP}"), 30, "CRD established")
    yield plural
    ext.delete_custom_resource_definition(f"{plural}.{GROUP}")


def _established(ext: client.ApiextensionsV1Api, name: str) -> bool:
    crd: Any = ext.read_custom_resource_definition(name)
    return any(c.type == "Established" and c.status == "True"
               for c in crd.status.conditions or [])


def test_cel_rule_rejects_bad_object_with_its_message(cluster: Cluster, namespace: str,
                                                      widget_crd: str) -> None:
    custom = client.CustomObjectsApi(cluster.admin_api())

    def widget(name: str, tp: int) -> dict[str, Any]:
        return {"apiVersion": f"{GROUP}/v1", "kind": f"W{widget_crd}",
                "metadata": {"name": name}, "spec": {"nodes": 2, "tp": tp}}

    def create(name: str, tp: int) -> None:
        # the CRD's discovery can lag its Established condition by a moment
        for _ in range(40):
            try:
                custom.create_namespaced_custom_object(GROUP, "v1", namespace, widget_crd,
                                                       widget(name, tp))
                return
            except ApiException as err:
                if err.status != 404:
                    raise
                time.sleep(0.25)
        raise AssertionError("CRD never served")

    create("good", 8)
    with pytest.raises(ApiException) as rejected:
        create("bad", 6)
    assert rejected.value.status == 422
    assert "tp must divide the job's neuron cores" in str(rejected.value.body)


def _service_account(core: client.CoreV1Api, namespace: str, name: str) -> None:
    core.create_namespaced_service_account(namespace, {  # type: ignore[arg-type]
        "apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}})


def _grant(cluster: Cluster, namespace: str, sa: str, resource: str, verbs: list[str]) -> None:
    rbac = client.RbacAuthorizationV1Api(cluster.admin_api())
    rbac.create_namespaced_role(namespace, {  # type: ignore[arg-type]
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
        "metadata": {"name": f"{sa}-{resource}"},
        "rules": [{"apiGroups": [""], "resources": [resource], "verbs": verbs}]})
    rbac.create_namespaced_role_binding(namespace, {  # type: ignore[arg-type]
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
        "metadata": {"name": f"{sa}-{resource}"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                    "name": f"{sa}-{resource}"},
        "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": namespace}]})


def test_rbac_denies_a_service_account_what_it_was_not_granted(
        cluster: Cluster, core: client.CoreV1Api, namespace: str) -> None:
    _service_account(core, namespace, "reader")
    _grant(cluster, namespace, "reader", "configmaps", ["get", "list"])
    as_sa = client.CoreV1Api(cluster.api_for(
        cluster.service_account_kubeconfig(namespace, "reader")))

    def granted() -> bool:  # the authorizer sees a new RoleBinding a moment after it exists
        try:
            as_sa.list_namespaced_config_map(namespace)
        except ApiException as err:
            if err.status != 403:
                raise
            return False
        return True

    wait_for(granted, 30, "the grant to take effect")
    for denied in (lambda: as_sa.list_namespaced_secret(namespace),
                   lambda: as_sa.list_namespaced_config_map("default")):
        with pytest.raises(ApiException) as err:
            denied()
        assert err.value.status == 403


def test_operator_credentials_work_under_rbac(cluster: Cluster, namespace: str) -> None:
    as_operator = client.CoreV1Api(cluster.api_for(cluster.operator_kubeconfig()))
    as_operator.list_namespaced_pod(namespace)
    as_operator.list_node()
    with pytest.raises(ApiException) as err:
        as_operator.list_namespaced_secret(namespace)
    assert err.value.status == 403


IN_POD_CLIENT = """
import json, os, ssl, urllib.request, urllib.error
sa = "/var/run/secrets/kubernetes.io/serviceaccount"
token = open(f"{sa}/token").read()
ctx = ssl.create_default_context(cafile=f"{sa}/ca.crt")
api = f"https://{os.environ['KUBERNETES_SERVICE_HOST']}:{os.environ['KUBERNETES_SERVICE_PORT']}"
def get(path):
    req = urllib.request.Request(api + path, headers={"Authorization": "Bearer " + token})
    try:
        with urllib.request.urlopen(req, context=ctx, timeout=10) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as err:
        return err.code, None
ns = open(f"{sa}/namespace").read()
code, me = get(f"/api/v1/namespaces/{ns}/pods/{os.environ['POD_NAME']}")
print("own", code, me and me["status"].get("podIP"))
code, _ = get("/api/v1/namespaces/kube-system/pods")
print("other", code)
"""


def test_pod_reads_its_own_pod_with_its_token_and_is_denied_another_namespace(
        cluster: Cluster, core: client.CoreV1Api, namespace: str) -> None:
    _service_account(core, namespace, "worker")
    _grant(cluster, namespace, "worker", "pods", ["get"])
    pod = python_pod("self-reader", IN_POD_CLIENT, serviceAccountName="worker", container={
        "env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}]})
    core.create_namespaced_pod(namespace, pod)  # type: ignore[arg-type]
    done = wait_pod_phase(core, namespace, "self-reader", {"Succeeded", "Failed"})
    log = cluster.pod_log(namespace, "self-reader")
    assert done.status.phase == "Succeeded", log
    assert f"own 200 {done.status.pod_ip}" in log
    assert "other 403" in log
