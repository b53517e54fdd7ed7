"""Objects a fresh cluster needs before anyone uses it: RBAC for CoreDNS and the operator.

The API server creates its own bootstrap roles (scheduler, controller manager, nodes); what it
cannot know about is our CoreDNS user and the HLAT operator. The operator's ClusterRole here is
what the rig grants until the Helm chart ships its own; it is deliberately limited to what the
architecture says the operator touches, so a test run as the operator notices a missing grant.
"""

from __future__ import annotations

from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

OPERATOR_NAMESPACE = "hlat-system"
OPERATOR_SERVICE_ACCOUNT = "hlat-operator"

Manifest = dict[str, Any]


def _rule(groups: list[str], resources: list[str], verbs: list[str]) -> dict[str, list[str]]:
    return {"apiGroups": groups, "resources": resources, "verbs": verbs}


_ALL = ["get", "list", "watch", "create", "update", "patch", "delete", "deletecollection"]
_READ = ["get", "list", "watch"]

COREDNS_RBAC: list[Manifest] = [
    {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": "hlat:coredns"},
        "rules": [_rule([""], ["endpoints", "services", "pods", "namespaces"], ["list", "watch"]),
                  _rule(["discovery.k8s.io"], ["endpointslices"], ["list", "watch"])],
    },
    {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": "hlat:coredns"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "hlat:coredns"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User",
                      "name": "hlat:coredns"}],
    },
]

OPERATOR_RBAC: list[Manifest] = [
    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": OPERATOR_NAMESPACE}},
    {"apiVersion": "v1", "kind": "ServiceAccount",
     "metadata": {"name": OPERATOR_SERVICE_ACCOUNT, "namespace": OPERATOR_NAMESPACE}},
    {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
        "metadata": {"name": "hlat-operator"},
        "rules": [
            _rule(["hlat.dev"], ["*"], _ALL),
            _rule([""], ["pods", "services", "configmaps", "serviceaccounts",
                         "persistentvolumeclaims"], _ALL),
            _rule([""], ["events"], ["create", "patch", "update"]),
            _rule(["events.k8s.io"], ["events"], ["create", "patch", "update"]),
            _rule([""], ["nodes", "namespaces"], _READ),
            _rule(["coordination.k8s.io"], ["leases"], _ALL),
            _rule(["rbac.authorization.k8s.io"], ["roles", "rolebindings"], _ALL),
            _rule(["apiextensions.k8s.io"], ["customresourcedefinitions"], _READ),
            _rule(["scheduling.volcano.sh"], ["podgroups"], _ALL),
        ],
    },
    {
        "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
        "metadata": {"name": "hlat-operator"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                    "name": "hlat-operator"},
        "subjects": [{"kind": "ServiceAccount", "name": OPERATOR_SERVICE_ACCOUNT,
                      "namespace": OPERATOR_NAMESPACE}],
    },
]


def apply(api: client.ApiClient, manifests: list[Manifest]) -> None:
    """Create each object, leaving ones that already exist alone."""
    from kubernetes import utils

    for manifest in manifests:
        try:
            utils.create_from_dict(api, manifest)  # type: ignore[no-untyped-call]
        except utils.FailToCreateError as err:
            if not all(isinstance(e, ApiException) and e.status == 409
                       for e in err.api_exceptions):
                raise


def service_account_token(api: client.ApiClient, namespace: str, name: str,
                          seconds: int = 86400) -> str:
    """A token for ``namespace/name`` from the TokenRequest API (as a pod would be given)."""
    request = client.AuthenticationV1TokenRequest(
        spec=client.V1TokenRequestSpec(audiences=[], expiration_seconds=seconds))
    response: Any = client.CoreV1Api(api).create_namespaced_service_account_token(
        name, namespace, request)
    return str(response.status.token)
