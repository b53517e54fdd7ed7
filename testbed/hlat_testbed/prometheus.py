"""A real Prometheus (3.x, built from its Go module) scraping the local cluster the way the chart
asks a Prometheus Operator to: its ServiceMonitor and PodMonitor, rendered by Helm, are turned
into Prometheus' own scrape configs with Kubernetes service discovery here, as the Prometheus
Operator would (one source of truth for what is scraped and how it is labelled).

What the translation covers is what the chart uses: a ServiceMonitor selecting Services of its
own namespace by labels, endpoints by port name, `honorLabels`; a PodMonitor selecting pods in
any namespace by labels, a container port by name, and `relabelings`. Both get the target labels
the Prometheus Operator adds (`namespace`, `pod`, `container`; `service` for a ServiceMonitor).

The operator runs as a host process on the rig, not in a pod: `expose_host_port` gives the
chart's metrics Service an EndpointSlice pointing at the host, which is what the Service's
selector would produce on EKS.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from hlat_testbed import build
from hlat_testbed.cluster import Cluster

PROCESS = "prometheus"
MONITORING_APIS = ("monitoring.coreos.com/v1/ServiceMonitor", "monitoring.coreos.com/v1/PodMonitor")


def chart_monitors(interval: str = "1s") -> list[dict[str, Any]]:
    """The chart's ServiceMonitor and PodMonitor as Helm renders them (the real Helm CLI)."""
    from hlat_testbed import chart

    build.build_component(build.HELM)
    argv = [str(build.HELM.binary("helm")), "template", chart.RELEASE, str(chart.CHART),
            "-n", chart.NAMESPACE, "--set", "image.repository=hlat-operator",
            "--set", "serviceMonitor.enabled=true", "--set", f"serviceMonitor.interval={interval}",
            "--set", "podMonitor.enabled=true", "--set", f"podMonitor.interval={interval}"]
    for api in MONITORING_APIS:
        argv += ["--api-versions", api]
    out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out)
            if d and d["kind"] in ("ServiceMonitor", "PodMonitor")]


def instantiate(expr: str, namespace: str, job: str, seconds: float) -> str:
    """A dashboard query as Grafana would send it for this namespace, job and time range."""
    window = f"{max(60, int(seconds) + 60)}s"
    return (expr.replace("$namespace", namespace).replace("$pretrainjob", job)
            .replace("$__range", window).replace("$__rate_interval", "30s"))


def _label_meta(kind: str, key: str) -> str:
    """`__meta_kubernetes_<kind>_label_<key>` with Prometheus' name sanitising."""
    return f"__meta_kubernetes_{kind}_label_{re.sub(r'[^a-zA-Z0-9_]', '_', key)}"


def _keep_labels(kind: str, match: dict[str, str]) -> list[dict[str, Any]]:
    return [{"source_labels": [_label_meta(kind, k)], "regex": re.escape(v), "action": "keep"}
            for k, v in sorted(match.items())]


def _relabelings(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Prometheus Operator relabelings (camelCase) as Prometheus relabel_configs."""
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label",
            "separator": "separator", "regex": "regex", "replacement": "replacement",
            "action": "action", "modulus": "modulus"}
    return [{keys[k]: v for k, v in item.items() if k in keys} for item in items]


def _common(kind: str) -> list[dict[str, Any]]:
    out = [{"source_labels": ["__meta_kubernetes_namespace"], "target_label": "namespace"},
           {"source_labels": ["__meta_kubernetes_pod_name"], "target_label": "pod"}]
    if kind == "pod":
        out.append({"source_labels": ["__meta_kubernetes_pod_container_name"],
                    "target_label": "container"})
    return out


def scrape_configs(monitors: list[dict[str, Any]], kubeconfig: Path) -> list[dict[str, Any]]:
    """Prometheus scrape configs for the chart's ServiceMonitors and PodMonitors."""
    out: list[dict[str, Any]] = []
    for mon in monitors:
        meta, spec = mon["metadata"], mon["spec"]
        if mon["kind"] == "ServiceMonitor":
            for i, ep in enumerate(spec["endpoints"]):
                relabel = _keep_labels("service", spec["selector"]["matchLabels"])
                relabel.append({"source_labels": ["__meta_kubernetes_endpointslice_port_name"],
                                "regex": re.escape(ep["port"]), "action": "keep"})
                relabel += _common("service")
                relabel.append({"source_labels": ["__meta_kubernetes_service_name"],
                                "target_label": "service"})
                relabel += _relabelings(ep.get("relabelings", []))
                out.append({
                    "job_name": f"serviceMonitor/{meta['namespace']}/{meta['name']}/{i}",
                    "honor_labels": bool(ep.get("honorLabels")),
                    "scrape_interval": ep.get("interval", "30s"),
                    "kubernetes_sd_configs": [{
                        "role": "endpointslice", "kubeconfig_file": str(kubeconfig),
                        "namespaces": {"names": [meta["namespace"]]}}],
                    "relabel_configs": relabel,
                })
        elif mon["kind"] == "PodMonitor":
            anywhere = (spec.get("namespaceSelector") or {}).get("any", False)
            for i, ep in enumerate(spec["podMetricsEndpoints"]):
                relabel = _keep_labels("pod", spec["selector"]["matchLabels"])
                relabel.append({"source_labels": ["__meta_kubernetes_pod_container_port_name"],
                                "regex": re.escape(ep["port"]), "action": "keep"})
                relabel += _common("pod")
                relabel += _relabelings(ep.get("relabelings", []))
                sd: dict[str, Any] = {"role": "pod", "kubeconfig_file": str(kubeconfig)}
                if not anywhere:
                    sd["namespaces"] = {"names": [meta["namespace"]]}
                out.append({
                    "job_name": f"podMonitor/{meta['namespace']}/{meta['name']}/{i}",
                    "honor_labels": bool(ep.get("honorLabels")),
                    "scrape_interval": ep.get("interval", "30s"),
                    "kubernetes_sd_configs": [sd],
                    "relabel_configs": relabel,
                })
    return out


def expose_host_port(api: client.ApiClient, namespace: str, service: str, host_ip: str,
                     port: int, port_name: str = "metrics") -> None:
    """An EndpointSlice for `service` pointing at a process on the rig's host."""
    body: Any = {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": f"{service}-rig", "namespace": namespace,
                     "labels": {"kubernetes.io/service-name": service,
                                "endpointslice.kubernetes.io/managed-by": "hlat-testbed"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [host_ip], "conditions": {"ready": True}}],
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
    }
    discovery = client.DiscoveryV1Api(api)
    try:
        discovery.create_namespaced_endpoint_slice(namespace, body)
    except ApiException as err:
        if err.status != 409:
            raise
        discovery.replace_namespaced_endpoint_slice(f"{service}-rig", namespace, body)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Prometheus:
    """One Prometheus process for a cluster, with its own data directory."""

    def __init__(self, cluster: Cluster, workdir: Path) -> None:
        self.cluster, self.workdir = cluster, workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self, configs: list[dict[str, Any]], interval: str = "1s",
              timeout: float = 60) -> Prometheus:
        build.build_component(build.PROMETHEUS)
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": interval, "evaluation_interval": interval},
            "scrape_configs": configs}))
        self.cluster.processes.stop(PROCESS)
        self.cluster.processes.start(PROCESS, [
            str(build.PROMETHEUS.binary("prometheus")), f"--config.file={config}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except OSError:
                time.sleep(0.5)
        log = self.cluster.processes.log_path(PROCESS)
        raise TimeoutError(f"prometheus not ready after {timeout}s; see {log}")

    def stop(self) -> None:
        self.cluster.processes.stop(PROCESS)

    def _get(self, path: str, params: dict[str, str]) -> Any:
        url = f"{self.url}{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=30) as resp:
            data = json.loads(resp.read())
        if data.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {data}")
        return data["data"]

    def targets(self) -> list[dict[str, Any]]:
        active: list[dict[str, Any]] = self._get("/api/v1/targets", {"state": "active"})[
            "activeTargets"]
        return active

    def query_range(self, expr: str, start: float, end: float, step: float = 1.0
                    ) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._get("/api/v1/query_range", {
            "query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}"}
        )["result"]
        return result
