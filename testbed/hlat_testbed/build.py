"""Build the control plane's binaries from their Go modules, once per pinned version.

No kube-apiserver, etcd or CoreDNS in a usable version ships in the registries this project can
reach, so we compile them from the upstream Go modules through small wrapper modules kept in the
repository (``testbed/k8s``, ``testbed/etcd``, ``testbed/coredns``, ``testbed/volcano``: Volcano's
scheduler, whose module resolves only with the ``replace`` block of its own go.mod, which the
wrapper carries). Design choices:

- The cache lives outside the repository, keyed by version (``~/.cache/hlat/k8s-v1.35.4/``):
  a pin change builds a new directory, an unchanged pin never rebuilds.
- The wrapper module is copied into the cache before building, so ``go get`` may rewrite its
  go.mod/go.sum without dirtying the checkout; the committed go.sum keeps builds reproducible.
- Kubernetes' version is stamped with ``-X`` ldflags (as hack/lib/version.sh does), otherwise
  kubectl and Helm cannot parse the server version.
- Two components at a time, each with ``-p 2``: a component spends much of its build waiting
  on module downloads or in a single-threaded link, which the other one fills; two links at once
  (the kube-apiserver's alone takes several GiB) still fit this machine's memory.
- A component is built under a file lock, so two processes that need it at once (two pytest
  workers, or a test run beside ``make cluster-build``) build it once.
- A binary appears in the cache only after a successful build (build to a temp name, rename).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

K8S_VERSION = "v1.35.4"
ETCD_VERSION = "v3.6.6"
COREDNS_VERSION = "v1.13.1"
VOLCANO_VERSION = "v1.10.0"
HELM_VERSION = "v3.19.2"
KUEUE_VERSION = "v0.17.0"
HELM_K8S_MINOR = 34
"""Minor version of the k8s.io/client-go that Helm v3.19.2's go.mod requires (v0.34.0): Helm's
Makefile stamps it as the default Kubernetes version of `helm template` and `helm lint`."""

TESTBED_DIR = Path(__file__).resolve().parent.parent
"""The ``testbed/`` source root, which holds the Go wrapper modules."""

Progress = Callable[[str], None]


def cache_root() -> Path:
    """Root of all build caches and cluster state; ``HLAT_CACHE`` overrides ``~/.cache/hlat``."""
    return Path(os.environ.get("HLAT_CACHE", Path.home() / ".cache" / "hlat"))


def go_binary() -> str:
    """The Go toolchain: ``$GO``, else ``go`` on PATH, else the usual /usr/local/go install."""
    for candidate in (os.environ.get("GO"), shutil.which("go"), "/usr/local/go/bin/go"):
        if candidate and Path(candidate).exists():
            return candidate
    raise RuntimeError("no Go toolchain found: install Go >= 1.26.7 or set GO=/path/to/go")


@dataclass(frozen=True)
class Component:
    """One wrapper module and the commands built from it."""

    name: str
    version: str
    module_dir: str
    """Wrapper module directory under testbed/."""
    commands: dict[str, str]
    """Binary name -> Go package path to build."""
    get: tuple[str, ...] = ()
    """Packages to ``go get`` first (adds what the command imports to the wrapper's go.mod)."""
    ldflags: tuple[str, ...] = field(default=())
    files: dict[str, str] = field(default_factory=dict)
    """File name in the cache's ``files/`` -> (module, path inside it) to copy there after the
    build, as ``module@version/path`` (e.g. the CRDs a component's binaries need)."""

    @property
    def bin_dir(self) -> Path:
        return cache_root() / f"{self.name}-{self.version}" / "bin"

    def binary(self, command: str) -> Path:
        return self.bin_dir / command

    @property
    def files_dir(self) -> Path:
        return cache_root() / f"{self.name}-{self.version}" / "files"

    def is_built(self) -> bool:
        return all(self.binary(c).exists() for c in self.commands) and all(
            (self.files_dir / f).exists() for f in self.files)


def _k8s_ldflags(version: str) -> tuple[str, ...]:
    major, minor = version.lstrip("v").split(".")[:2]
    flags: list[str] = []
    for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
        flags += [
            f"-X {pkg}.gitVersion={version}",
            f"-X {pkg}.gitMajor={major}",
            f"-X {pkg}.gitMinor={minor}",
            f"-X {pkg}.gitTreeState=clean",
            f"-X {pkg}.buildDate=1970-01-01T00:00:00Z",
        ]
    return tuple(flags)


_K8S_COMMANDS = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubectl")

KUBERNETES = Component(
    name="k8s",
    version=K8S_VERSION,
    module_dir="k8s",
    commands={c: f"k8s.io/kubernetes/cmd/{c}" for c in _K8S_COMMANDS},
    get=tuple(f"k8s.io/kubernetes/cmd/{c}@{K8S_VERSION}" for c in _K8S_COMMANDS),
    ldflags=_k8s_ldflags(K8S_VERSION),
)
ETCD = Component(
    name="etcd",
    version=ETCD_VERSION,
    module_dir="etcd",
    commands={"etcd": "."},
    get=(f"go.etcd.io/etcd/server/v3/etcdmain@{ETCD_VERSION}",),
)
COREDNS = Component(
    name="coredns",
    version=COREDNS_VERSION,
    module_dir="coredns",
    commands={"coredns": "github.com/coredns/coredns"},
    get=(f"github.com/coredns/coredns@{COREDNS_VERSION}",),
)
_VOLCANO_CRDS = "installer/helm/chart/volcano/crd/bases"
VOLCANO = Component(
    name="volcano",
    version=VOLCANO_VERSION,
    module_dir="volcano",
    commands={"vc-scheduler": "volcano.sh/volcano/cmd/scheduler"},
    get=(f"volcano.sh/volcano/cmd/scheduler@{VOLCANO_VERSION}",),
    files={name: f"volcano.sh/volcano@{VOLCANO_VERSION}/{_VOLCANO_CRDS}/{name}" for name in (
        "scheduling.volcano.sh_podgroups.yaml", "scheduling.volcano.sh_queues.yaml",
        "nodeinfo.volcano.sh_numatopologies.yaml")},
)
"""Volcano's gang scheduler (its go.mod's `replace` block is carried by testbed/volcano)."""
def _helm_ldflags(version: str, k8s_minor: int) -> tuple[str, ...]:
    """What Helm's Makefile passes: without them its default Kubernetes version is v1.20 and
    `helm template` refuses a chart whose kubeVersion asks for more."""
    flags = [f"-X helm.sh/helm/v3/internal/version.version={version}",
             "-X helm.sh/helm/v3/internal/version.gitTreeState=clean"]
    for pkg in ("helm.sh/helm/v3/pkg/lint/rules", "helm.sh/helm/v3/pkg/chartutil"):
        flags += [f"-X {pkg}.k8sVersionMajor=1", f"-X {pkg}.k8sVersionMinor={k8s_minor}"]
    return tuple(flags)


HELM = Component(
    name="helm",
    version=HELM_VERSION,
    module_dir="helm",
    commands={"helm": "helm.sh/helm/v3/cmd/helm"},
    get=(f"helm.sh/helm/v3/cmd/helm@{HELM_VERSION}",),
    ldflags=_helm_ldflags(HELM_VERSION, HELM_K8S_MINOR),
)
"""The Helm CLI, for the chart's lint/template/install tests and the demo's install."""
PROMETHEUS_VERSION = "v0.316.0"
"""Prometheus 3's Go module version (Debian's 2.42 lacks Kubernetes service discovery)."""
PROMETHEUS = Component(
    name="prometheus",
    version=PROMETHEUS_VERSION,
    module_dir="prometheus",
    commands={c: f"github.com/prometheus/prometheus/cmd/{c}" for c in ("prometheus", "promtool")},
    get=tuple(f"github.com/prometheus/prometheus/cmd/{c}@{PROMETHEUS_VERSION}"
              for c in ("prometheus", "promtool")),
)
"""A real Prometheus scraping the local cluster, and promtool for the alert rule tests."""
_KUEUE_CRDS = "config/components/crd/bases"
KUEUE_CRD_FILES = tuple(f"kueue.x-k8s.io_{kind}.yaml" for kind in (
    "admissionchecks", "clusterqueues", "cohorts", "localqueues", "multikueueclusters",
    "multikueueconfigs", "provisioningrequestconfigs", "resourceflavors", "topologies",
    "workloadpriorityclasses", "workloads"))
"""Every CRD of Kueue's module, from the bases, which have no conversion webhook (v1beta2 is their storage
version); the released manifests patch in a conversion webhook this rig does not serve."""
KUEUE = Component(
    name="kueue",
    version=KUEUE_VERSION,
    module_dir="kueue",
    commands={"kueue": "sigs.k8s.io/kueue/cmd/kueue"},
    get=(f"sigs.k8s.io/kueue/cmd/kueue@{KUEUE_VERSION}",),
    files={name: f"sigs.k8s.io/kueue@{KUEUE_VERSION}/{_KUEUE_CRDS}/{name}"
           for name in KUEUE_CRD_FILES},
)
"""Kueue's manager, for the queue/quota/preemption and topology-aware admission tests."""
COMPONENTS = (ETCD, KUBERNETES, COREDNS, VOLCANO, HELM, PROMETHEUS, KUEUE)


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    # sum.golang.org is unreachable here; the proxy plus the committed go.sum are the check.
    env.setdefault("GOSUMDB", "off")
    env["GOFLAGS"] = (env.get("GOFLAGS", "") + " -mod=mod -buildvcs=false").strip()
    env.setdefault("GOTOOLCHAIN", "local")
    return env


def _run_go(args: list[str], cwd: Path, log: Path) -> None:
    with log.open("a") as out:
        out.write(f"$ go {' '.join(args)}\n")
        out.flush()
        proc = subprocess.run(
            [go_binary(), *args], cwd=cwd, env=_go_env(), stdout=out, stderr=subprocess.STDOUT
        )
    if proc.returncode != 0:
        tail = log.read_text().splitlines()[-30:]
        raise RuntimeError(f"go {args[0]} failed in {cwd} (log {log}):\n" + "\n".join(tail))


def _prepare_workdir(component: Component) -> Path:
    work = cache_root() / f"{component.name}-{component.version}" / "src"
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(TESTBED_DIR / component.module_dir, work)
    return work


@contextmanager
def _locked(component: Component) -> Iterator[None]:
    """Hold the component's build lock (waits while another process builds it)."""
    component.bin_dir.mkdir(parents=True, exist_ok=True)
    with open(component.bin_dir.parent / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build_component(component: Component, progress: Progress = print) -> None:
    """Build every missing binary of ``component`` into its cache directory."""
    if component.is_built():
        return
    with _locked(component):
        if not component.is_built():  # another process may have built it meanwhile
            _build(component, progress)


def _build(component: Component, progress: Progress) -> None:
    log = component.bin_dir.parent / "build.log"
    work = _prepare_workdir(component)
    started = time.monotonic()
    for package in component.get:
        progress(f"[build] go get {package}")
        _run_go(["get", package], work, log)
    ldflags = " ".join(("-s", "-w", *component.ldflags))
    for command, package in component.commands.items():
        if component.binary(command).exists():
            continue
        progress(f"[build] {component.name} {component.version}: {command} (log: {log})")
        tmp = component.bin_dir / f".{command}.tmp"
        _run_go(["build", "-p", "2", "-trimpath", "-ldflags", ldflags, "-o", str(tmp), package],
                work, log)
        tmp.rename(component.binary(command))
    _copy_files(component, work, log)
    progress(f"[build] {component.name} {component.version} done in {time.monotonic() - started:.0f}s")


def _copy_files(component: Component, work: Path, log: Path) -> None:
    """Copy the component's files out of the Go module cache (the module is downloaded)."""
    if not component.files:
        return
    modcache = subprocess.run([go_binary(), "env", "GOMODCACHE"], cwd=work, env=_go_env(),
                              capture_output=True, text=True, check=True).stdout.strip()
    component.files_dir.mkdir(parents=True, exist_ok=True)
    for name, source in component.files.items():
        path = Path(modcache) / source
        if not path.exists():
            raise RuntimeError(f"{source} is not in the Go module cache {modcache} (log {log})")
        shutil.copyfile(path, component.files_dir / name)


def ensure_built(progress: Progress = print) -> None:
    """Build whatever is missing from the cache, two components at a time, the longest builds
    first; a no-op when everything is there."""
    missing = sorted((c for c in COMPONENTS if not c.is_built()), key=_build_order)
    with ThreadPoolExecutor(max_workers=2) as pool:
        for future in [pool.submit(build_component, c, progress) for c in missing]:
            future.result()  # the first failure is raised (the other build still finishes)


def _build_order(component: Component) -> int:
    """Longest cold builds first (measured on 2 cores: k8s 362 s, prometheus 293 s, volcano
    257 s, coredns 232 s, helm 115 s, etcd 40 s; kueue about 8 min alone (issue 30), 930 s beside two
    soaks), so the two lanes end close together."""
    order = ("kueue", "k8s", "prometheus", "volcano", "coredns", "helm", "etcd")
    return order.index(component.name) if component.name in order else len(order)


def component_file(component: Component, name: str) -> Path:
    """A file copied into the component's cache at build time (see Component.files)."""
    return component.files_dir / name


def binary(command: str) -> Path:
    """Path of a cached binary by command name (``kubectl``, ``etcd``, ...)."""
    for component in COMPONENTS:
        if command in component.commands:
            return component.binary(command)
    raise KeyError(command)


def main() -> None:
    """``python -m hlat_testbed.build``: build the cache (CI runs this before the tests)."""
    started = time.monotonic()
    ensure_built(lambda line: print(line, flush=True))
    print(f"[build] all binaries ready in {time.monotonic() - started:.0f}s under {cache_root()}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
