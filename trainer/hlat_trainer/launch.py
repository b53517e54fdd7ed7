"""`hlat-launch`: turn the operator's environment into the torchrun line, then supervise it.

Every worker pod runs this as its entrypoint (Dockerfile.trainer). It reads the HLAT_* variables
the operator sets (`hlat_api.Env`) and the trainer config (HLAT_CONFIG: the PretrainJob spec,
JSON or YAML), adds the Neuron environment computed from the spec (`neuron_env`), and runs

    [neuron_parallel_compile] torchrun --nnodes N --nproc-per-node P --node-rank R
        --master-addr A --master-port PORT --max-restarts 0 -m hlat_trainer --config FILE [ARGS]

Choices:
- A small supervisor, not an exec: torchrun runs as its child; SIGTERM, SIGINT and SIGHUP are
  forwarded to it (the kubelet's SIGTERM on deletion reaches it at once), and the pod's exit
  code is torchrun's (128+n when a signal ended it), except that a trainer that failed for a
  reason no restart can fix (`ExitCode.CONFIG_ERROR`, written to HLAT_EXIT_FILE by the
  trainer) makes the pod exit with that code: torchrun itself reports every failed child as 1,
  which would have the operator restart a job that can never run.
- `--max-restarts 0`: the operator restarts the whole gang from the last checkpoint; torchrun
  restarting one node's workers alone would only wait for peers that are not coming back.
- Static rendezvous at HLAT_MASTER_ADDR:HLAT_MASTER_PORT (node rank 0's pod, through the
  headless Service), so node ranks are the operator's, stable and known in advance.
- One node (HLAT_NNODES=1): `torchrun --standalone` instead: a local rendezvous on a free port,
  nothing to reach, so HLAT_NODE_RANK / HLAT_MASTER_* are not needed (and ignored).
- HLAT_NNODES and HLAT_NPROC_PER_NODE fall back to the spec's `nodes` and processes per node,
  so `HLAT_CONFIG=job.yaml hlat-launch` also works by hand on one machine.
- A variable already in the environment wins over the computed Neuron one (an explicit
  `env:` in the pod is a deliberate override); the overrides are printed.
- The launcher does not import torch: errors in the env or config are reported at once.

On a Neuron backend the node's driver (`/sys/module/neuron/version`, or the file the pod names
in HLAT_NEURON_DRIVER_FILE, checked then whatever the backend) is checked against the oldest
the pinned image's runtime supports, before anything starts: a driver too old is the node's
fault, not the job's, and exits `ExitCode.NODE_FAULT` (the operator avoids the node).
Also on Neuron:
- the node-local compile cache is seeded from the shared copy before the workers start and
  new graphs are published back while they run and when they end (`compile_cache.CacheSync`,
  bounded in time, failures reported and never fatal);
- across nodes, NEURON_RT_ROOT_COMM_ID is node rank 0's IP and a port of the attempt
  (`neuron_env.root_comm_id`), resolved when each attempt starts: an address that does not
  resolve in time ends the pod with exit code 1 (the operator restarts the gang);
- a NEURON_COMPILE_CACHE_URL the pod sets, which the compiler would ignore in favour of the
  launcher's `--cache_dir`, is refused (`neuron_env.cache_url_conflict`).

Missing or invalid variables and bad configs print one line naming the variable or field and
exit with `ExitCode.CONFIG_ERROR` (permanent: restarting the gang cannot fix them).
`hlat-launch --dry-run` prints the environment it adds and the command instead of running it.
Arguments after `--` go to the trainer (e.g. `-- --set train.steps=4`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from hlat_api import Env, ExitCode, InvalidSpecError, PretrainJobSpec, load_job
from hlat_api.presets import ULTRASERVER_INSTANCE_TYPES, canonical_instance_type
from hlat_trainer.backends import is_neuron, resolve_backend_name
from hlat_trainer.compile_cache import CacheSync
from hlat_trainer.neuron_env import (
    NEURON_DRIVER_FILE_ENV,
    NEURON_DRIVER_VERSION_FILE,
    ROOT_COMM_ID,
    RootCommError,
    UltraServerError,
    cache_url_conflict,
    check_neuron_driver,
    compile_command_prefix,
    root_comm_id,
    shared_cache_dir,
    ultraserver_environment,
    worker_environment,
)


class LaunchError(ValueError):
    """The environment or config cannot make a launch; the message names the variable."""


def _int_var(env: Mapping[str, str], var: Env, default: int | None, minimum: int) -> int:
    raw = env.get(var)
    if raw is None or raw == "":
        if default is None:
            raise LaunchError(f"${var} is not set (the operator sets it in every worker pod)")
        return default
    try:
        value = int(raw)
    except ValueError:
        raise LaunchError(f"${var}={raw!r} is not an integer") from None
    if value < minimum:
        raise LaunchError(f"${var}={value} must be at least {minimum}")
    return value


def _rendezvous_args(env: Mapping[str, str], nnodes: int) -> list[str]:
    if nnodes == 1:
        return ["--standalone"]
    node_rank = _int_var(env, Env.NODE_RANK, None, 0)
    if node_rank >= nnodes:
        raise LaunchError(f"${Env.NODE_RANK}={node_rank} must be below ${Env.NNODES}={nnodes}")
    addr = env.get(Env.MASTER_ADDR, "").strip()
    if not addr:
        raise LaunchError(f"${Env.MASTER_ADDR} is not set (node rank 0's address, needed "
                          f"when ${Env.NNODES} > 1)")
    port = _int_var(env, Env.MASTER_PORT, None, 1)
    if port > 65535:
        raise LaunchError(f"${Env.MASTER_PORT}={port} is not a TCP port")
    return ["--node-rank", str(node_rank), "--master-addr", addr, "--master-port", str(port)]


def build_command(
    env: Mapping[str, str], spec: PretrainJobSpec, trainer_args: Sequence[str] = ()
) -> tuple[list[str], dict[str, str]]:
    """The argv to exec and the variables to add to `env` (those `env` already has are kept)."""
    config = env.get(Env.CONFIG, "").strip()
    if not config:
        raise LaunchError(f"${Env.CONFIG} is not set (path of the PretrainJob spec, JSON/YAML)")
    nnodes = _int_var(env, Env.NNODES, spec.nodes, 1)
    nproc = _int_var(env, Env.NPROC_PER_NODE, spec.ranks_per_node, 1)
    try:
        prefix = compile_command_prefix(spec)
    except ValueError as err:
        raise LaunchError(str(err)) from None
    argv = [
        *prefix, "torchrun", "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
        *_rendezvous_args(env, nnodes), "--max-restarts", "0",
        "-m", "hlat_trainer", "--config", config, *trainer_args,
    ]
    computed = worker_environment(spec, nnodes=nnodes)
    extra = {k: v for k, v in computed.items() if k not in env}
    return argv, extra


def own_bin_first(path: str) -> str:
    """PATH with this interpreter's directory first: torchrun (and the trainer it starts) is
    the one installed beside hlat-launch, whatever PATH the container (or the local rig's
    kubelet) was started with."""
    own = os.path.dirname(sys.executable)
    return os.pathsep.join([own, *(p for p in path.split(os.pathsep) if p and p != own)])


class NodeFaultError(Exception):
    """The node cannot run this image (its Neuron driver is too old): a node fault, not the
    job's: `ExitCode.NODE_FAULT`, so the operator moves the gang off this node."""


def driver_file(env: Mapping[str, str]) -> str | None:
    """The driver version file to check: the pod's HLAT_NEURON_DRIVER_FILE (checked on any
    backend: the pod asked for it), else sysfs's on a Neuron backend (None: no check)."""
    return env.get(NEURON_DRIVER_FILE_ENV) or None


def read_driver_version(path: str = NEURON_DRIVER_VERSION_FILE) -> str | None:
    """The node's Neuron kernel driver version (sysfs is visible in containers), if readable."""
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    args = list(sys.argv[1:] if argv is None else argv)
    trainer_args: list[str] = []
    if "--" in args:
        cut = args.index("--")
        args, trainer_args = args[:cut], args[cut + 1:]
    p = argparse.ArgumentParser(prog="hlat-launch", description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true",
                   help="print the added environment and the command, run nothing")
    return p.parse_args(args), trainer_args


def main(argv: Sequence[str] | None = None) -> int:
    launched = time.monotonic()  # the attempt's time accounting starts here (hlat_trainer.ledger)
    args, trainer_args = parse_args(argv)
    env = dict(os.environ)
    try:
        config = env.get(Env.CONFIG, "").strip()
        if not config:
            raise LaunchError(f"${Env.CONFIG} is not set (path of the PretrainJob spec, JSON/YAML)")
        spec = load_job(config).spec
        command, extra = build_command(env, spec, trainer_args)
        neuron = is_neuron(resolve_backend_name(spec))
        conflict = cache_url_conflict(env, spec) if neuron else None
        if conflict:
            raise LaunchError(conflict)
        version_file = driver_file(env) or (NEURON_DRIVER_VERSION_FILE if neuron else None)
        if version_file and not args.dry_run:
            problem = check_neuron_driver(read_driver_version(version_file))
            if problem:  # a property of this node, not of the job: another node may do
                raise NodeFaultError(problem)
    except (LaunchError, InvalidSpecError) as err:
        print(f"hlat-launch: {err}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    except NodeFaultError as err:
        print(f"hlat-launch: {err} (node fault: exit {int(ExitCode.NODE_FAULT)})",
              file=sys.stderr)
        return ExitCode.NODE_FAULT
    out = sys.stdout if args.dry_run else sys.stderr
    nnodes = _int_var(env, Env.NNODES, spec.nodes, 1)  # validated by build_command
    kept = sorted(k for k in worker_environment(spec, nnodes=nnodes) if k in env)
    if kept:
        print(f"# kept from the environment: {', '.join(kept)}", file=out)
    for key, value in sorted(extra.items()):
        print(f"{key}={shlex.quote(value)}", file=out)
    if env.get(Env.GANG_LEASE):
        print("# restartStrategy InPlace: hlat-launch starts and restarts the workers itself; "
              "the torchrun line below is their equivalent", file=out)
    root_comm = neuron and nnodes > 1 and ROOT_COMM_ID not in env
    shared = shared_cache_dir(spec)
    if root_comm:
        print(f"# {ROOT_COMM_ID}=<node rank 0's IP>:<port of the attempt>, resolved at start",
              file=out)
    if shared:
        print(f"# compile cache: {spec.neuron.cache_dir} seeded from {shared}, new graphs "
              "published back", file=out)
    print(shlex.join(command), file=out, flush=True)
    if args.dry_run:
        return ExitCode.OK
    in_place = bool(env.get(Env.GANG_LEASE)) and not compile_command_prefix(spec)
    # the launcher's own modules' warnings (peers, snapshot copies, the record's reads) timed
    # as its `hlat-launch:` lines; the trainers it starts configure their own logging
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s hlat-launch: %(message)s")
    cache = (CacheSync(spec.neuron.cache_dir, shared, pull=in_place and env.get(Env.SPARE) == "1",
                       say=lambda line: print(f"hlat-launch: {line}", file=sys.stderr, flush=True))
             if shared else None)
    try:
        if cache is not None:
            cache.seed()
            cache.start()
        return _run(env, spec, extra, command, launched, in_place, root_comm)
    except RootCommError as err:  # not permanent: a new attempt may find the address
        print(f"hlat-launch: {err}", file=sys.stderr)
        return 1
    except UltraServerError as err:  # the job's placement or configuration: permanent
        print(f"hlat-launch: {err}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    finally:
        if cache is not None:
            cache.stop()


def _run(env: Mapping[str, str], spec: PretrainJobSpec, extra: dict[str, str],
         command: Sequence[str], launched: float, in_place: bool, root_comm: bool) -> int:
    """Start the workers: the in-place agent, or torchrun under the supervisor."""
    if in_place:
        base = {**env, **extra, "PATH": own_bin_first(env.get("PATH", ""))}
        return run_in_place(env, spec, base, command, launched, root_comm)
    per_attempt = _attempt_vars(env, spec, root_comm)
    if per_attempt is not None:
        nnodes = _int_var(env, Env.NNODES, spec.nodes, 1)
        extra = {**extra, **per_attempt(
            env.get(Env.MASTER_ADDR, "127.0.0.1").strip(),
            _int_var(env, Env.NODE_RANK, 0, 0) if nnodes > 1 else 0, nnodes,
            _int_var(env, Env.ATTEMPT, 0, 0))}
    exit_file = Path(tempfile.mkdtemp(prefix="hlat-launch-")) / "exit-code"
    try:
        return supervise(command, {**env, **extra, Env.LAUNCHED_MONOTONIC: f"{launched:.6f}",
                                   Env.EXIT_FILE: str(exit_file),
                                   "PATH": own_bin_first(env.get("PATH", ""))}, exit_file)
    except OSError as err:  # not found in the image: permanent, a restart cannot fix it
        print(f"hlat-launch: cannot run {command[0]}: {err}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR


FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def run_in_place(env: Mapping[str, str], spec: PretrainJobSpec, base: dict[str, str],
                 command: Sequence[str], launched: float, root_comm: bool = False) -> int:
    """`restartStrategy: InPlace`: the agent starts and restarts this node's workers itself
    (`hlat_trainer.agent`); SIGTERM from the kubelet stops them and ends the pod."""
    from hlat_trainer import agent

    nnodes = _int_var(env, Env.NNODES, spec.nodes, 1)
    nproc = _int_var(env, Env.NPROC_PER_NODE, spec.ranks_per_node, 1)
    multi = nnodes > 1
    layout = agent.NodeLayout(
        nnodes, nproc, _int_var(env, Env.NODE_RANK, 0, 0) if multi else 0,
        env.get(Env.MASTER_ADDR, "127.0.0.1") if multi else "127.0.0.1",
        _int_var(env, Env.MASTER_PORT, 29500, 1) if multi else 0)
    if nproc > 1:
        base.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default with several workers
    trainer_argv = list(command[command.index("hlat_trainer") + 1:])
    spare = env.get(Env.SPARE) == "1"
    base[Env.SNAPSHOT_DIR] = snapshot_dir()
    runner = agent.Agent(layout, trainer_argv, base, agent.LeaseControl.from_environment(env),
                         spec.fault_tolerance.backoff.max_seconds + agent.WAIT_MARGIN_SECONDS,
                         pod=env.get(Env.POD_NAME, ""), spare=spare,
                         attempt_env=_attempt_vars(env, spec, root_comm),
                         watch_peers=multi,
                         replicate=(multi and spec.snapshot_interval is not None
                                    and spec.checkpoint.memory_replicas > 0))

    def stop(sig: int, _frame: object) -> None:
        raise SystemExit(128 + sig)

    for sig in FORWARDED:
        signal.signal(sig, stop)
    attempt = -1 if spare else _int_var(env, Env.ATTEMPT, 0, 0)
    try:
        return runner.run(attempt, _int_var(env, Env.STEPS_DONE, 0, 0), launched)
    finally:  # the pod's snapshots go with the launcher: nothing else would free the memory
        shutil.rmtree(base[Env.SNAPSHOT_DIR], ignore_errors=True)


SHM = Path("/dev/shm")


def snapshot_dir(shm: Path = SHM) -> str:
    """A directory of this pod's for the trainers' in-memory snapshots (HLAT_SNAPSHOT_DIR):
    on /dev/shm (the pod's memory-backed emptyDir) where it is writable, else the temporary
    directory; the launcher outlives every trainer it restarts in place, so what they keep
    there survives their crashes."""
    where = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    return tempfile.mkdtemp(prefix="hlat-snapshots-", dir=where)


def _attempt_vars(env: Mapping[str, str], spec: PretrainJobSpec, root_comm: bool
                  ) -> Callable[[str, int, int, int], dict[str, str]] | None:
    """The variables each attempt sets from (node rank 0's address, this node's rank, the node
    count, the attempt): NEURON_RT_ROOT_COMM_ID where `root_comm`, and on an UltraServer
    instance type its runtime's topology variables (a pod that sets them keeps its own).
    None: neither."""
    ultra = (canonical_instance_type(spec.instance_type) in ULTRASERVER_INSTANCE_TYPES
             and is_neuron(resolve_backend_name(spec))
             and "NEURON_RT_ULTRASERVER_MODE" not in env)
    if not root_comm and not ultra:
        return None

    def variables(master_addr: str, node_rank: int, nnodes: int, attempt: int
                  ) -> dict[str, str]:
        out = {ROOT_COMM_ID: root_comm_id(master_addr, attempt)} if root_comm else {}
        if ultra:
            out.update(ultraserver_environment(node_rank, nnodes, master_addr, env))
        return out
    return variables


def supervise(command: Sequence[str], env: Mapping[str, str], exit_file: Path) -> int:
    """Run `command`, forwarding signals to it; its exit code, or CONFIG_ERROR / NODE_FAULT
    when the trainer left that code in `exit_file`."""
    proc = subprocess.Popen(list(command), env=dict(env))

    def forward(sig: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    code = proc.wait()
    with contextlib.suppress(OSError, ValueError):
        said = int(exit_file.read_text().strip())
        if said in (ExitCode.CONFIG_ERROR, ExitCode.NODE_FAULT):
            return said
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
