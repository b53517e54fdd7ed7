"""`hlat-train --config FILE [--set key.path=value ...]`: train one job.

FILE is a PretrainJob manifest (its spec is used, its name names the checkpoint directory) or a
bare spec. A bad config, dataset, tokenizer or checkpoint prints what to fix and exits with
`ExitCode.CONFIG_ERROR`, which the operator treats as permanent. An error the Neuron runtime
raises for a hardware fault (`neuron_env.neuron_device_error`) exits with `ExitCode.NODE_FAULT`:
the operator restarts the job off that node.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from hlat_api import Env, ExitCode, InvalidSpecError, PretrainJobSpec, load_job
from hlat_trainer.errors import UserError

if TYPE_CHECKING:
    from hlat_trainer.backends import Backend

BackendFactory = Callable[[PretrainJobSpec], "Backend"]

log = logging.getLogger("hlat_trainer")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hlat-train", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.environ.get(Env.CONFIG),
                   help=f"PretrainJob manifest or spec, YAML or JSON (default: ${Env.CONFIG})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a spec field by its camelCase path, e.g. train.steps=40")
    p.add_argument("--job-name", default=os.environ.get(Env.JOB_NAME),
                   help="job name for the checkpoint directory (default: metadata.name)")
    p.add_argument("--log-format", choices=["json", "bar"], default=os.environ.get(Env.LOG_FORMAT),
                   help="per-step output (default: bar on a terminal, json otherwise)")
    p.add_argument("--metrics-port", type=int, default=int(os.environ.get(Env.METRICS_PORT) or 0),
                   help="serve Prometheus metrics on this port (0: off)")
    args = p.parse_args(argv)
    if not args.config:
        p.error(f"--config is required (or set ${Env.CONFIG})")
    return args


def main(argv: list[str] | None = None, *, backend: BackendFactory | None = None) -> int:
    """The command; `backend` replaces the spec's backend (a device stack out of this tree)."""
    args = parse_args(argv)
    # every rank logs; the prefix says which (torchrun's RANK; absent for a single process)
    rank = f"[rank {os.environ['RANK']}] " if "RANK" in os.environ else ""
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s {rank}%(levelname)s %(name)s: %(message)s")
    try:
        return _run(args, backend)
    except (InvalidSpecError, UserError) as err:
        print(f"hlat-train: {err}", file=sys.stderr)
        exit_file = os.environ.get(Env.EXIT_FILE)
        if exit_file:  # torchrun reports any failure as 1: tell hlat-launch it is for good
            with contextlib.suppress(OSError):
                Path(exit_file).write_text(str(int(ExitCode.CONFIG_ERROR)))
        return ExitCode.CONFIG_ERROR
    except Exception as err:
        from hlat_trainer.neuron_env import neuron_device_error

        found = neuron_device_error(f"{type(err).__name__}: {err}")
        if found is None:
            raise
        log.exception("the Neuron runtime reported a hardware error (%s): this node's "
                      "device is at fault; exiting %d so the job moves off it", found,
                      int(ExitCode.NODE_FAULT))
        _leave_exit_code(ExitCode.NODE_FAULT)
        return ExitCode.NODE_FAULT


def _leave_exit_code(code: ExitCode) -> None:
    """torchrun reports any failed worker as 1: the exit file tells hlat-launch which code."""
    exit_file = os.environ.get(Env.EXIT_FILE)
    if exit_file:
        with contextlib.suppress(OSError):
            Path(exit_file).write_text(str(int(code)))


def _run(args: argparse.Namespace, backend: BackendFactory | None) -> int:
    job = load_job(args.config, args.overrides, name=args.job_name)
    if os.environ.get("WORLD_SIZE", "").isdigit():  # an elastic job at the size it runs at
        job = replace(job, spec=job.spec.at_world(int(os.environ["WORLD_SIZE"])))
    # the loader tokenizes in one background thread; keep HF tokenizers' Rayon pool from
    # competing with the training threads for every core
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    # torch is imported only now, so `--help` and config errors answer at once
    from hlat_trainer.distributed import shutdown
    from hlat_trainer.metrics import TrainMetrics
    from hlat_trainer.report import JsonLines, ProgressBar
    from hlat_trainer.train import Trainer

    fmt = args.log_format or ("bar" if sys.stdout.isatty() else "json")
    trainer = Trainer(job, backend=backend(job.spec) if backend else None)
    metrics = TrainMetrics()
    if args.metrics_port and trainer.world.local_rank == 0:
        port = metrics.serve(args.metrics_port)
        log.info("Prometheus metrics on :%d/metrics", port)
    trainer.sinks.append(metrics.update)
    bar = None
    if trainer.world.rank == 0:  # one line per step for the whole job, not one per rank
        if fmt == "bar":
            bar = ProgressBar(job.spec.total_steps, initial=trainer.engine.latest_step() or 0)
            trainer.sinks.append(bar)
        else:
            trainer.sinks.append(JsonLines())
    try:
        trainer.run()
    finally:
        if bar:
            bar.close()
        shutdown()
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
