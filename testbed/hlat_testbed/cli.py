"""``hlat-cluster``: the one command people, the demo and CI use to drive the local cluster.

    hlat-cluster up [--nodes N] [--instance-type T] [--provisioner P]
                                                      build if needed, start, add nodes
    hlat-cluster down                                 stop everything, remove all state
    hlat-cluster status                               components and nodes
    hlat-cluster kubeconfig [--operator]              path for ``export KUBECONFIG=...``
    hlat-cluster kubectl ARGS...                      the cached kubectl as admin
    hlat-cluster logs POD [-n NS] [-c CONTAINER]      a pod process's stdout/stderr
    hlat-cluster fault kill|hang|resume POD [-n NS] [-c C] [--signal SIG]
    hlat-cluster fault condition NODE TYPE=STATUS [--reason R] [--message M]
    hlat-cluster node down|up|delete NODE
    hlat-cluster volume CLAIM --path DIR [-n NS]     a ReadWriteMany PVC backed by DIR ("FSx")

Must run as root (network namespaces, bind mounts). ``HLAT_CLUSTER_DIR`` selects the state
directory, ``HLAT_CACHE`` the build cache.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from hlat_testbed import build, controlplane, faults, podfiles
from hlat_testbed.config import ClusterConfig
from hlat_testbed.eksnodes import DEFAULT_PROVISIONER, PROVISIONERS
from hlat_testbed.instancetypes import DEFAULT_INSTANCE_TYPE, INSTANCE_TYPES


def _progress(line: str) -> None:
    print(f"hlat-cluster: {line}", file=sys.stderr, flush=True)


def _signal(name: str) -> int:
    name = name.upper()
    if name.isdigit():
        return int(name)
    return int(getattr(signal, name if name.startswith("SIG") else f"SIG{name}"))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hlat-cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build if needed and start the cluster (idempotent)")
    up.add_argument("--nodes", type=int, default=2)
    up.add_argument("--instance-type", default=DEFAULT_INSTANCE_TYPE,
                    choices=sorted(INSTANCE_TYPES))
    up.add_argument("--provisioner", default=DEFAULT_PROVISIONER, choices=PROVISIONERS,
                    help="model the nodes as an EKS managed node group (default), Karpenter, "
                         "EKS Auto Mode or SageMaker HyperPod makes them (docs/testbed.md)")
    sub.add_parser("down", help="stop everything and remove the cluster's state")
    sub.add_parser("status", help="show components and nodes")
    kc = sub.add_parser("kubeconfig", help="print the admin kubeconfig's path")
    kc.add_argument("--operator", action="store_true",
                    help="the operator service account's kubeconfig instead")
    kubectl = sub.add_parser("kubectl", help="run kubectl as admin")
    kubectl.add_argument("args", nargs=argparse.REMAINDER)
    logs = sub.add_parser("logs", help="print a pod process's output")
    logs.add_argument("pod")
    logs.add_argument("-n", "--namespace", default="default")
    logs.add_argument("-c", "--container")
    fault = sub.add_parser("fault", help="kill, hang or resume a pod's process, or set a "
                           "node's condition (condition NODE TYPE=STATUS [--reason R])")
    fault.add_argument("action", choices=["kill", "hang", "resume", "condition"])
    fault.add_argument("pod", metavar="POD|NODE")
    fault.add_argument("setting", nargs="?", metavar="TYPE=STATUS",
                       help="for condition: e.g. AcceleratedHardwareReady=False")
    fault.add_argument("--reason", default="", help="for condition: its reason")
    fault.add_argument("--message", default="", help="for condition: its message")
    fault.add_argument("-n", "--namespace", default="default")
    fault.add_argument("-c", "--container")
    fault.add_argument("--signal", default="KILL", help="for kill: name or number")
    node = sub.add_parser("node", help="take a node down, bring it up, or delete it")
    node.add_argument("action", choices=["down", "up", "delete"])
    node.add_argument("node")
    gang = sub.add_parser("volcano", help="start or stop Volcano's gang scheduler (built once)")
    gang.add_argument("action", choices=["up", "down"])
    queues = sub.add_parser("kueue", help="start or stop Kueue's manager (built once)")
    queues.add_argument("action", choices=["up", "down"])
    volume = sub.add_parser("volume", help="create a PVC backed by a host directory")
    volume.add_argument("claim")
    volume.add_argument("--path", required=True, type=Path)
    volume.add_argument("-n", "--namespace", default="default")
    volume.add_argument("--size", default="1200Gi")
    return parser


def _fault(cfg: ClusterConfig, args: argparse.Namespace) -> None:
    ns = args.namespace
    if args.action == "kill":
        pid = faults.kill(cfg, ns, args.pod, _signal(args.signal), args.container)
    elif args.action == "hang":
        pid = faults.hang(cfg, ns, args.pod, args.container)
    else:
        pid = faults.resume(cfg, ns, args.pod, args.container)
    print(f"{args.action} {ns}/{args.pod} (pid {pid})")


_NEEDS_ROOT = ("up", "down", "fault", "node", "volume", "volcano", "kueue")


def _light(cfg: ClusterConfig, args: argparse.Namespace) -> int | None:
    """Commands that need no API client (importing the kubernetes client costs seconds)."""
    if args.command == "kubectl":
        argv = [str(build.binary("kubectl")), f"--kubeconfig={cfg.admin_kubeconfig}", *args.args]
        os.execv(argv[0], argv)
    if args.command == "kubeconfig" and not args.operator:
        print(cfg.admin_kubeconfig)
    elif args.command == "status":
        table = controlplane.processes(cfg)
        names = [*controlplane.COMPONENTS, *[n for n in table.names() if n.startswith("kubelet-")]]
        pids = {n: table.pid(n) for n in names}
        for name, pid in pids.items():
            print(f"{name:28} {pid or 'stopped'}")
        print(f"kubeconfig: {cfg.admin_kubeconfig}")
        return 0 if all(pids[c] for c in controlplane.COMPONENTS) else 1
    elif args.command == "logs":
        sys.stdout.write(podfiles.pod_log(cfg, args.namespace, args.pod, args.container))
    elif args.command == "fault" and args.action != "condition":
        _fault(cfg, args)
    elif args.command == "node" and args.action != "delete":
        (faults.node_down if args.action == "down" else faults.node_up)(cfg, args.node)
        print(f"node {args.node} {args.action}")
    else:
        return None
    return 0


def run(args: argparse.Namespace) -> int:
    if args.command in _NEEDS_ROOT and os.geteuid() != 0:
        raise RuntimeError(f"`{args.command}` needs root (network namespaces, bind mounts)")
    cfg = ClusterConfig.default()
    done = _light(cfg, args)
    if done is not None:
        return done
    from hlat_testbed.cluster import Cluster

    cluster = Cluster(cfg)
    if args.command == "up":
        cluster.up(args.nodes, args.instance_type, progress=_progress,
                   provisioner=args.provisioner)
    elif args.command == "down":
        cluster.down(progress=_progress)
    elif args.command == "kubeconfig":
        print(cluster.operator_kubeconfig())
    elif args.command == "fault":  # condition: through the API server
        kind, _, status = (args.setting or "").partition("=")
        if not kind or not status:
            raise SystemExit("hlat-cluster fault condition NODE TYPE=STATUS: give e.g. "
                             "AcceleratedHardwareReady=False")
        faults.set_node_condition(cluster.admin_api(), args.pod, kind, status, args.reason,
                                  args.message)
        print(f"node {args.pod}: {kind}={status} ({args.reason or kind})")
    elif args.command == "node":
        faults.node_delete(cfg, cluster.admin_api(), args.node)
        print(f"node {args.node} deleted")
    elif args.command == "volcano":
        from hlat_testbed import volcano

        if args.action == "up":
            volcano.start(cluster)
            print("vc-scheduler runs: pods with schedulerName volcano are gang-scheduled")
        else:
            volcano.stop(cluster)
    elif args.command == "kueue":
        from hlat_testbed import kueue

        if args.action == "up":
            kueue.start(cluster)
            print(f"kueue runs: PretrainJobs labelled kueue.x-k8s.io/queue-name wait for "
                  f"admission (log: {cluster.processes.log_path(kueue.PROCESS)})")
        else:
            kueue.stop(cluster)
    elif args.command == "volume":
        cluster.create_shared_volume(args.namespace, args.claim, args.path.resolve(), args.size)
        print(f"pvc {args.namespace}/{args.claim} -> {args.path.resolve()}")
    return 0


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    try:
        sys.exit(run(args))
    except (RuntimeError, ValueError) as err:
        print(f"hlat-cluster: error: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
