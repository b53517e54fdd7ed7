"""`hlat-eval --config FILE [--step N] [--output FILE]`: the held-out loss of one durable checkpoint.

The evaluator of our own (issue 33): it loads the weights of one complete checkpoint (the
newest, or step N) into one process, whatever data- and tensor-parallel layout saved them
(torch.distributed.checkpoint reshards as it loads), and takes the mean token loss of
`spec.eval`'s held-out set over the micro-batches the run's in-loop evaluation reads
(`eval.batches`, the same set at every data-parallel degree), all of them here. Same model,
precision and batches: the value is the run's `validationLoss` at that step, up to the order
of the reduction.

While it reads, it holds the checkpoint with a reader file (`hlat_api.layout.READERS`, refreshed
every `READER_REFRESH_SECONDS`), which the trainer's retention respects: `checkpoint.keep` deletes
no checkpoint being read. It writes one JSON object, `{"validationLoss": ...}`, to `--output`
(default `$HLAT_EVAL_RESULT`), else to stdout, and logs the step, the perplexity and the
micro-batches read. Checkpoints of the torch-native engines (backends cpu, cuda, neuron-native)
are torch.distributed.checkpoint directories; the neuron-xla stack's are NxD's own format, whose
model shards `hlat_trainer.nxd_checkpoint` reads and joins (any tensor-parallel degree, kv
heads not replicated over ranks). A bad config or checkpoint
prints what to fix and exits with `ExitCode.CONFIG_ERROR`.

`hlat-eval --hold` reads nothing: it holds the checkpoint until SIGTERM. It is the sidecar of
every evaluation Job the operator runs (spec.evaluation), so that retention waits for an
evaluator of the user's own (lm-evaluation-harness, say) that knows nothing of reader files.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hlat_api import Env, ExitCode, InvalidSpecError, PretrainJobSpec, load_job
from hlat_api.layout import (
    DONE,
    PENDING_READER,
    READER_REFRESH_SECONDS,
    READERS,
    CheckpointEntry,
    latest_complete,
    step_dir,
)
from hlat_trainer.errors import UserError

log = logging.getLogger("hlat_trainer.evaluate")

SCORES = ("validationLoss",)
"""What the result file holds (`--output`, `$HLAT_EVAL_RESULT`): the perplexity, its exp, is
left out (it would dwarf every other score on a dashboard panel of them)."""
DCP_METADATA = ".metadata"
"""The file torch.distributed.checkpoint writes last in a checkpoint it saved."""


def evaluation_spec(spec: PretrainJobSpec, backend: str = "cpu", held_out: bool = True
                    ) -> PretrainJobSpec:
    """The run's spec for one process: one node of one rank, no tensor or sequence parallelism
    (the checkpoint is resharded as it loads), no snapshots. The held-out set is the same at
    every data-parallel degree (`train.held_out_batches`): this process reads all of it
    (`held_out`: the spec must name one)."""
    if held_out and spec.eval is None:
        raise UserError("spec.eval is not set: hlat-eval takes the loss of its held-out set "
                        "(eval.path); add eval to the job's spec")
    raw: dict[str, Any] = spec.model_dump(by_alias=True, exclude_none=True)
    raw.update(nodes=1, processesPerNode=1, instanceType="cpu" if backend == "cpu" else
               raw["instanceType"], backend=backend)
    raw["parallelism"] = {**raw["parallelism"], "tensor": 1, "pipeline": 1,
                          "sequenceParallel": False}
    raw["checkpoint"] = {**raw["checkpoint"], "memoryInterval": "off"}
    raw.pop("elastic", None)
    return PretrainJobSpec.model_validate(raw)


def choose(root: str, job: str, step: int | None) -> CheckpointEntry:
    """The checkpoint to read: step `step`, else the newest complete one."""
    if step is None:
        entry = latest_complete(root, job)
        if entry is None:
            raise UserError(f"no complete checkpoint under {Path(root) / job} (a step_<N> "
                            f"directory with `{DONE}`): nothing to evaluate yet")
        return entry
    entry = CheckpointEntry(step, step_dir(root, job, step))
    if not entry.complete:
        raise UserError(f"checkpoint {entry.path} is not complete (no `{DONE}`): it is being "
                        "written, was deleted, or never existed; --step names a complete one")
    return entry


@contextlib.contextmanager
def reading(path: Path, refresh: float = READER_REFRESH_SECONDS) -> Iterator[Path]:
    """Hold the checkpoint at `path` while the block reads it: a reader file under its
    `readers/`, its time refreshed every `refresh` seconds, removed at the end. The checkpoint
    must still be complete once held (retention may have been deleting it)."""
    mark = path / READERS / f"{socket.gethostname()}-{os.getpid()}"
    mark.parent.mkdir(exist_ok=True)
    mark.touch()
    stop = threading.Event()

    def refresh_loop() -> None:
        while not stop.wait(refresh):
            with contextlib.suppress(OSError):
                os.utime(mark)

    keeper = threading.Thread(target=refresh_loop, name="hlat-eval-reader", daemon=True)
    keeper.start()
    try:
        if not (path / DONE).is_file():
            raise UserError(f"checkpoint {path} was deleted as the evaluation began "
                            "(checkpoint.keep): evaluate a newer one")
        yield mark
    finally:
        stop.set()
        keeper.join(timeout=5)
        mark.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            mark.parent.rmdir()  # only when no other reader holds it


def load(spec: PretrainJobSpec, job: str, entry: CheckpointEntry, backend_name: str = "cpu",
         held_out: bool = True) -> tuple[Any, Any]:
    """The model of the checkpoint at `entry` in this one process, held while read: (its
    engine, the backend); `evaluation_spec` says how the run's spec is cut down for it."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    from hlat_trainer import nxd_checkpoint
    from hlat_trainer.backends import select_backend
    from hlat_trainer.engine import build_engine
    from hlat_trainer.export import unwrapped

    nxd = not (entry.path / DCP_METADATA).is_file()
    if nxd and not nxd_checkpoint.is_nxd(entry.path):
        raise UserError(f"checkpoint {entry.path} has neither {DCP_METADATA} (the torch-native "
                        "backends' checkpoints: cpu, cuda, neuron-native) nor NxD's "
                        f"{nxd_checkpoint.MODEL_DIR}/ shards (neuron-xla): not a checkpoint "
                        "of ours")
    one = evaluation_spec(spec, backend_name, held_out)
    backend = select_backend(one)
    world = backend.init_world()
    engine = build_engine(one, job, backend, world, backend.device(world.local_rank))
    with reading(entry.path):
        if nxd:
            nxd_checkpoint.load_into(engine.model, entry.path, unwrapped,
                                     spec.model.dims(), spec.instance_type)
            return engine, backend
        try:
            dcp_load({"model": engine.model.state_dict()}, checkpoint_id=entry.path)
        except Exception as err:
            raise UserError(f"checkpoint {entry.path} could not be read: {err}") from err
    return engine, backend


def evaluate(spec: PretrainJobSpec, job: str, entry: CheckpointEntry,
             backend_name: str = "cpu") -> dict[str, Any]:
    """The held-out loss of the checkpoint at `entry` (see the module doc)."""
    from hlat_trainer.data import load_tokenizer
    from hlat_trainer.train import held_out_batches

    engine, backend = load(spec, job, entry, backend_name)
    one = engine.spec
    world = engine.world
    batches = held_out_batches(one, load_tokenizer(one.data.tokenizer), world.dp, world.dp_rank)
    (loss,) = backend.to_host([engine.eval_loss(batches)])
    value = float(loss)
    return {"step": entry.step, "tokens": entry.step * spec.tokens_per_step,
            "validationLoss": value, "validationPerplexity": math.exp(min(value, 700.0)),
            "microBatches": len(batches)}


def hold(path: Path) -> None:
    """Hold the checkpoint at `path` until SIGTERM or SIGINT (the kubelet stops a sidecar
    with SIGTERM once the evaluator's container has ended)."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with reading(path):
        # the trainer's hold for an evaluation yet to start is this one's now
        (path / READERS / PENDING_READER).unlink(missing_ok=True)
        log.info("holding %s against checkpoint.keep until stopped", path)
        stop.wait()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hlat-eval", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.environ.get(Env.CONFIG),
                   help=f"PretrainJob manifest or spec, YAML or JSON (default: ${Env.CONFIG})")
    p.add_argument("--job-name", default=os.environ.get(Env.JOB_NAME),
                   help="job name of the checkpoint directory (default: metadata.name)")
    step = os.environ.get(Env.EVAL_STEP)
    p.add_argument("--step", type=int, default=int(step) if step else None,
                   help=f"the checkpoint's step (default: ${Env.EVAL_STEP}, else the newest "
                   "complete one)")
    p.add_argument("--output", default=os.environ.get(Env.EVAL_RESULT),
                   help=f"write the result here (default: ${Env.EVAL_RESULT}, else stdout)")
    p.add_argument("--backend", choices=["cpu", "cuda"], default="cpu",
                   help="the device to evaluate on (default: cpu)")
    p.add_argument("--hold", action="store_true",
                   help="read nothing: hold the checkpoint against checkpoint.keep until "
                   "SIGTERM (the sidecar of an evaluation Job)")
    args = p.parse_args(argv)
    if not args.config:
        p.error(f"--config is required (or set ${Env.CONFIG})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        job = load_job(args.config, name=args.job_name)
        entry = choose(job.spec.checkpoint.dir, job.name, args.step)
        if args.hold:
            hold(entry.path)
            return 0
        result = evaluate(job.spec, job.name, entry, args.backend)
    except (InvalidSpecError, UserError) as err:
        print(f"hlat-eval: {err}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    finally:
        from hlat_trainer.distributed import shutdown

        shutdown()
    # the scores alone: the operator publishes every number as a metric, and the checkpoint's
    # step and tokens are in its status entry already
    text = json.dumps({k: result[k] for k in SCORES})
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
    else:
        print(text)
    log.info("step_%d: validation loss %.4f (perplexity %.4g) over %d micro-batches",
             result["step"], result["validationLoss"], result["validationPerplexity"],
             result["microBatches"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
