"""The few typing seams between the rig and the kubernetes Python client.

The client's generated models declare every field Optional, yet a Pod or Node read back from
the API server always has metadata, spec and status. Rather than scatter hundreds of asserts
through the kubelet, objects read from the API are typed ``Pod``/``Node`` (``Any``) at the
boundary, and everything the rig computes itself stays precisely typed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeAlias

from kubernetes import client, config

from hlat_api.apitimeouts import bound_requests

Pod: TypeAlias = Any
"""A ``V1Pod`` as returned by the API server (metadata, spec and status present)."""
Obj: TypeAlias = Any
"""Any other object read from the API server."""


def api_client(kubeconfig: Path) -> client.ApiClient:
    """An API client for one kubeconfig file (never the process-global default)."""
    api: client.ApiClient = config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
    api.configuration.connection_pool_maxsize = 32
    return bound_requests(api)
