"""A warm standby worker (`python -m hlat_trainer.standby`), started by the in-place agent
(`hlat_trainer.agent`) ahead of the attempt it will run.

It imports torch and the trainer and does ahead what every attempt does the same way (`prewarm`:
the modules the trainer imports lazily, the tokenizer parsed), then blocks on one line of JSON
on its stdin:
`{"env": {...}, "argv": [...]}`, the attempt's environment (rank, rendezvous, Lease, attempt)
and the trainer's arguments. It adds the environment and runs the trainer exactly as
`python -m hlat_trainer` would. End of input without a line: it was not needed; it exits 0.

What it imports while waiting must not read the attempt's environment at import: torch_xla
does (on a Neuron host `import torch_xla` gives the process its NeuronCore from LOCAL_RANK, and
only when TORCHELASTIC_RUN_ID is set: torch_xla/__init__.py:119-140 and
torch_xla/_internal/neuron.py:49-89 at v2.9.0), so it is left to the trainer, which imports it
once the attempt's environment is in place (tests/xla/test_worker_env_neuron.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys

WAITING_NAME = b"hlat-standby"
RUNNING_NAME = b"hlat-trainer"
"""The process name (/proc/PID/comm) while waiting and once handed an attempt: what tells a
running trainer from a standby in `ps` (and the local rig's fault injection)."""


def set_process_name(name: bytes) -> None:
    """prctl(PR_SET_NAME); a no-op where there is no libc (not Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)


def prewarm(argv: list[str]) -> None:
    """What an attempt would otherwise pay for after the restart, done while waiting: the
    modules imported on first use (DeviceMesh imports torch._dynamo at its first sub-mesh,
    0.8 s on CPU; DCP at the first checkpoint) and the job's tokenizer parsed. Anything wrong
    here (a config that does not load) is left for the attempt itself to report."""
    import torch._dynamo
    import torch.distributed.checkpoint  # noqa: F401

    from hlat_api import load_job
    from hlat_trainer.cli import parse_args
    from hlat_trainer.data.tokenizer import parse_ahead

    try:
        args = parse_args(argv)
        parse_ahead(load_job(args.config, args.overrides, name=args.job_name).spec.data.tokenizer)
    except (Exception, SystemExit):  # the attempt reports it, naming the field
        return


def main(argv: list[str] | None = None) -> int:
    set_process_name(WAITING_NAME)
    import torch  # noqa: F401  (the point: paid for before the restart, not during it)

    import hlat_trainer.train  # noqa: F401
    from hlat_trainer.cli import main as train

    prewarm(sys.argv[1:] if argv is None else argv)

    line = sys.stdin.readline()
    if not line.strip():
        return 0
    order = json.loads(line)
    set_process_name(RUNNING_NAME)
    os.environ.update({str(k): str(v) for k, v in order["env"].items()})
    return train([str(a) for a in order["argv"]])


if __name__ == "__main__":
    sys.exit(main())
