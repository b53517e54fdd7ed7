"""How long a checkpoint blocks training: asynchronous (DCP async_save) vs synchronous save of the
same state, side by side in one run, through hlat_trainer.checkpoint.Checkpointer.

The state is a model and its AdamW state (fp32 weights + 2 moments) plus a loader position, as
the trainer saves it. Blocking time is what `Checkpointer.save` costs the training loop; for the
asynchronous save the time until the checkpoint is complete (`done` written) is shown too.

    .venv/bin/python bench/bench_checkpoint.py [--preset 125m] [--rounds 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from hlat_api import MODEL_PRESETS
from hlat_api.layout import step_dir
from hlat_trainer.checkpoint import Checkpointer
from hlat_trainer.model import build_model


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="125m", choices=sorted(MODEL_PRESETS))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    a = p.parse_args()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    model = build_model(MODEL_PRESETS[a.preset])
    opt = torch.optim.AdamW(model.parameters(), foreach=True)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    opt.step()
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    root = Path(tempfile.mkdtemp(dir=a.dir, prefix="hlat-bench-ckpt-"))
    results: dict[str, list[float]] = {"sync": [], "async": [], "async_done": []}
    for r in range(a.rounds):
        for mode in ("sync", "async"):
            ck = Checkpointer(root, mode, keep=1, async_=mode == "async")
            state = {"model": model.state_dict(), "optimizer": opt.state_dict(),
                     "loader.dp0": {"epoch": 0, "doc": r, "offset": 7}}
            start = time.perf_counter()
            blocked = ck.save(r + 1, state)
            ck.wait()
            while not (step_dir(root, mode, r + 1) / "done").exists():
                time.sleep(0.01)
            results[mode].append(blocked)
            if mode == "async":
                results["async_done"].append(time.perf_counter() - start)
    sync, asyn = statistics.median(results["sync"]), statistics.median(results["async"])
    print(f"state: {a.preset} model + AdamW, {nbytes / 2**30:.2f} GiB; {a.rounds} rounds; "
          f"writing to {root}")
    print(f"{'save':<28}{'blocks training (s)':>22}")
    print(f"{'synchronous (dcp.save)':<28}{sync:>22.3f}")
    print(f"{'asynchronous (async_save)':<28}{asyn:>22.3f}   "
          f"(complete after {statistics.median(results['async_done']):.3f} s)")
    print(f"ratio sync / async blocking: {sync / asyn:.1f}x")
    dist.destroy_process_group()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
