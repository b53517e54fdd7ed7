"""Turn a Pod's spec into what a local process needs: files for its volumes, its environment.

This is the part of a kubelet that reads ConfigMaps, Secrets, PVCs and service-account tokens
with the node's own credentials, so the Node authorizer decides, as on a real node, what the
kubelet may read (only objects its pods reference). Volumes become directories under the pod's
state directory; ``podrun`` bind-mounts them at their mount paths.

Supported volume sources: emptyDir, hostPath, configMap, secret, downwardAPI, projected
(serviceAccountToken, configMap, secret, downwardAPI: what the ServiceAccount admission plugin
injects) and persistentVolumeClaim bound to a hostPath or local PersistentVolume (how the rig
offers a shared "FSx" directory). Env supports value, fieldRef, resourceFieldRef, configMapKeyRef,
secretKeyRef, envFrom and ``$(VAR)`` expansion.
"""

from __future__ import annotations

import base64
import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from kubernetes import client
from kubernetes.client.exceptions import ApiException
from kubernetes.utils import parse_quantity

from hlat_testbed.kube import Obj, Pod

T = TypeVar("T")


class PodConfigError(RuntimeError):
    """The pod references something that does not exist or cannot be read."""


def with_authz_retry(call: Callable[[], T], attempts: int = 20) -> T:
    """Retry 403s briefly: the Node authorizer learns of a new pod's references asynchronously."""
    for attempt in range(attempts):
        try:
            return call()
        except ApiException as err:
            if err.status != 403 or attempt == attempts - 1:
                raise
            time.sleep(0.25)
    raise AssertionError("unreachable")


class PodResolver:
    """Reads what one pod references, with the node's API client."""

    def __init__(self, api: client.ApiClient, pod: Pod, pod_ip: str, host_ip: str,
                 node_allocatable: dict[str, str]) -> None:
        self.core = client.CoreV1Api(api)
        self.pod = pod
        self.ns: str = pod.metadata.namespace
        self.pod_ip, self.host_ip = pod_ip, host_ip
        self.allocatable = node_allocatable

    # --- lookups ---------------------------------------------------------------------------
    def config_map(self, name: str, optional: bool = False) -> dict[str, str] | None:
        try:
            cm = with_authz_retry(lambda: self.core.read_namespaced_config_map(name, self.ns))
        except ApiException as err:
            if err.status == 404 and optional:
                return None
            raise PodConfigError(f"configmap {self.ns}/{name}: {err.reason}") from err
        data = dict(cm.data or {})
        data.update({k: base64.b64decode(v).decode(errors="replace")
                     for k, v in (cm.binary_data or {}).items()})
        return data

    def secret(self, name: str, optional: bool = False) -> dict[str, str] | None:
        try:
            s = with_authz_retry(lambda: self.core.read_namespaced_secret(name, self.ns))
        except ApiException as err:
            if err.status == 404 and optional:
                return None
            raise PodConfigError(f"secret {self.ns}/{name}: {err.reason}") from err
        return {k: base64.b64decode(v).decode(errors="replace") for k, v in (s.data or {}).items()}

    def field(self, path: str) -> str:
        meta, spec = self.pod.metadata, self.pod.spec
        simple = {
            "metadata.name": meta.name, "metadata.namespace": meta.namespace,
            "metadata.uid": meta.uid, "spec.nodeName": spec.node_name,
            "spec.serviceAccountName": spec.service_account_name or "default",
            "status.podIP": self.pod_ip, "status.podIPs": self.pod_ip,
            "status.hostIP": self.host_ip, "status.hostIPs": self.host_ip,
        }
        if path in simple:
            return str(simple[path])
        match = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if match:
            return str((getattr(meta, match[1]) or {}).get(match[2], ""))
        if path in ("metadata.labels", "metadata.annotations"):
            items = getattr(meta, path.split(".")[1]) or {}
            return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
        raise PodConfigError(f"unsupported fieldRef {path}")

    def resource(self, container: Obj, resource: str) -> str:
        kind, _, name = resource.partition(".")
        res = container.resources
        values = (getattr(res, kind, None) if res else None) or {}
        return str(values.get(name) or self.allocatable.get(name, "0"))

    def service_account_token(self, audience: str | None, seconds: int) -> str:
        sa = self.pod.spec.service_account_name or "default"
        ref = client.V1BoundObjectReference(api_version="v1", kind="Pod",
                                            name=self.pod.metadata.name, uid=self.pod.metadata.uid)
        spec = client.V1TokenRequestSpec(audiences=[audience] if audience else [],
                                          expiration_seconds=seconds, bound_object_ref=ref)
        body = client.AuthenticationV1TokenRequest(spec=spec)
        resp: Obj = with_authz_retry(
            lambda: self.core.create_namespaced_service_account_token(sa, self.ns, body))
        return str(resp.status.token)

    def pvc_host_path(self, claim: str) -> str:
        """The directory behind a bound PVC whose PV is hostPath or local."""
        pvc: Obj = with_authz_retry(
            lambda: self.core.read_namespaced_persistent_volume_claim(claim, self.ns))
        if not pvc.spec.volume_name:
            raise PodConfigError(f"pvc {self.ns}/{claim} is not bound")
        pv: Obj = with_authz_retry(lambda: self.core.read_persistent_volume(pvc.spec.volume_name))
        source = pv.spec.host_path or pv.spec.local
        if source is None:
            raise PodConfigError(f"pv {pv.metadata.name} is neither hostPath nor local")
        return str(source.path)


# --- volumes -------------------------------------------------------------------------------
def _write_items(target: Path, data: dict[str, str], items: list[Any] | None,
                 mode: int | None) -> None:
    target.mkdir(parents=True, exist_ok=True)
    pairs = [(i.key, i.path, i.mode) for i in items] if items else [(k, k, None) for k in data]
    for key, rel, item_mode in pairs:
        if key not in data:
            continue
        path = target / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(data[key])
        path.chmod(item_mode or mode or 0o644)


def _downward_items(resolver: PodResolver, items: list[Any]) -> dict[str, str]:
    return {i.path: resolver.field(i.field_ref.field_path) for i in items if i.field_ref}


def _projected(resolver: PodResolver, target: Path, sources: list[Any], mode: int | None) -> None:
    target.mkdir(parents=True, exist_ok=True)
    for src in sources:
        if src.service_account_token:
            tok = src.service_account_token
            token = resolver.service_account_token(tok.audience, tok.expiration_seconds or 3607)
            _write_items(target, {tok.path: token}, None, mode or 0o600)
        if src.config_map:
            data = resolver.config_map(src.config_map.name, bool(src.config_map.optional))
            _write_items(target, data or {}, src.config_map.items, mode)
        if src.secret:
            data = resolver.secret(src.secret.name, bool(src.secret.optional))
            _write_items(target, data or {}, src.secret.items, mode)
        if src.downward_api:
            _write_items(target, _downward_items(resolver, src.downward_api.items), None, mode)


def materialize_volume(resolver: PodResolver, volume: Obj, volumes_dir: Path) -> Path:
    """Create the host directory for ``volume`` and return it."""
    target: Path = volumes_dir / volume.name
    if volume.host_path:
        path = Path(volume.host_path.path)
        if volume.host_path.type in (None, "", "DirectoryOrCreate"):
            path.mkdir(parents=True, exist_ok=True)
        return path
    if volume.persistent_volume_claim:
        claim: str = volume.persistent_volume_claim.claim_name
        return Path(resolver.pvc_host_path(claim))
    if volume.empty_dir is not None:
        target.mkdir(parents=True, exist_ok=True)
    elif volume.config_map:
        data = resolver.config_map(volume.config_map.name, bool(volume.config_map.optional))
        _write_items(target, data or {}, volume.config_map.items, volume.config_map.default_mode)
    elif volume.secret:
        data = resolver.secret(volume.secret.secret_name, bool(volume.secret.optional))
        _write_items(target, data or {}, volume.secret.items, volume.secret.default_mode)
    elif volume.projected:
        _projected(resolver, target, volume.projected.sources or [],
                   volume.projected.default_mode)
    elif volume.downward_api:
        _write_items(target, _downward_items(resolver, volume.downward_api.items or []), None,
                     volume.downward_api.default_mode)
    else:
        raise PodConfigError(f"volume {volume.name}: unsupported source")
    return target


# --- environment ---------------------------------------------------------------------------
_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: known names expand, ``$$`` escapes, others stay."""
    def sub(m: re.Match[str]) -> str:
        if m[0] == "$$":
            return "$"
        return env.get(m[1], m[0])
    return _REF.sub(sub, value)


def base_env(hostname: str, api_host: str, api_port: int) -> dict[str, str]:
    """What every container starts with: the host's "image" plus the Kubernetes service env."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get(
        "PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")])
    return {
        "PATH": path, "HOME": "/root", "HOSTNAME": hostname, "LANG": "C.UTF-8",
        "KUBERNETES_SERVICE_HOST": api_host, "KUBERNETES_SERVICE_PORT": str(api_port),
        "KUBERNETES_SERVICE_PORT_HTTPS": str(api_port),
        "KUBERNETES_PORT": f"tcp://{api_host}:{api_port}",
    }


def _env_from(resolver: PodResolver, container: Obj) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.env_from or []:
        prefix = source.prefix or ""
        data: dict[str, str] | None = None
        if source.config_map_ref:
            ref = source.config_map_ref
            data = resolver.config_map(ref.name, bool(ref.optional))
        elif source.secret_ref:
            data = resolver.secret(source.secret_ref.name, bool(source.secret_ref.optional))
        env.update({prefix + k: v for k, v in (data or {}).items()})
    return env


def _env_value(resolver: PodResolver, container: Obj, var: Obj,
               env: dict[str, str]) -> str | None:
    source: Obj = var.value_from
    if source is None:
        return expand(var.value or "", env)
    if source.field_ref:
        return resolver.field(source.field_ref.field_path)
    if source.resource_field_ref:
        return resolver.resource(container, source.resource_field_ref.resource)
    if source.config_map_key_ref:
        ref = source.config_map_key_ref
        return (resolver.config_map(ref.name, bool(ref.optional)) or {}).get(ref.key)
    if source.secret_key_ref:
        ref = source.secret_key_ref
        return (resolver.secret(ref.name, bool(ref.optional)) or {}).get(ref.key)
    raise PodConfigError(f"env {var.name}: unsupported valueFrom")


def container_env(resolver: PodResolver, container: Obj,
                  base: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    env.update(_env_from(resolver, container))
    for var in container.env or []:
        value = _env_value(resolver, container, var, env)
        if value is not None:
            env[var.name] = value
    return env


def container_argv(container: Obj, env: dict[str, str]) -> list[str]:
    """command + args with ``$(VAR)`` expanded; no image means no entrypoint to fall back on."""
    argv = [*(container.command or []), *(container.args or [])]
    if not container.command:
        raise PodConfigError(
            f"container {container.name}: the process kubelet runs host commands and needs "
            "`command` (there is no image entrypoint)")
    return [expand(a, env) for a in argv]


def memory_limit(container: Obj) -> int | None:
    """The container's `resources.limits.memory` in bytes, or None."""
    limits = (container.resources.limits if container.resources is not None else None) or {}
    raw = limits.get("memory")
    return int(parse_quantity(raw)) if raw else None
