"""The Helm chart on the local cluster: the operator runs with the identity the chart gives it.

`operator_kubeconfig` installs (or upgrades) the chart with the real Helm CLI
(hlat_testbed.build.HELM) as release `hlat` in `hlat-system`, with no operator replica (the rig
cannot run the operator's image; the operator runs as a local process instead) and without the
CRD (installed as `kubectl apply -f crds/` would, by the demo and the tests), and returns a
kubeconfig holding a TokenRequest token of the chart's ServiceAccount. The demo, every
end-to-end test and the recovery bench run the operator with it, so a permission the chart
lacks fails them, not a user.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from hlat_testbed import build
from hlat_testbed.cluster import Cluster

RELEASE = "hlat"
NAMESPACE = "hlat-system"
SERVICE_ACCOUNT = RELEASE
"""The chart's fullname for this release (the release name contains the chart's name)."""
CHART = Path(__file__).resolve().parents[2] / "charts" / "hlat"


def install(cluster: Cluster, *sets: str, release: str = RELEASE,
            namespace: str = NAMESPACE) -> None:
    """`helm upgrade --install` the chart, no operator replica and no CRD, plus `sets`."""
    build.build_component(build.HELM)
    argv = [str(build.HELM.binary("helm")), "upgrade", "--install", release, str(CHART),
            "-n", namespace, "--create-namespace", f"--kubeconfig={cluster.kubeconfig}",
            "--set", "replicaCount=0", "--set", "crds.install=false"]
    for value in sets:
        argv += ["--set", value]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"helm upgrade --install {release} failed: {proc.stderr.strip()}")


def operator_kubeconfig(cluster: Cluster) -> Path:
    """Credentials of the chart's ServiceAccount (every namespace watched), chart installed."""
    install(cluster)
    return cluster.service_account_kubeconfig(NAMESPACE, SERVICE_ACCOUNT)
