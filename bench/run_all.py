"""`make bench`: run every benchmark in bench/, each printing its ratios against a baseline."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--data", help="sample dataset directory (hlat-data sample --out DIR)")
    a = p.parse_args()
    runs = [
        ["bench_model.py", "--size", "tiny"],
        ["bench_model.py", "--size", "small", "--batch", "2", "--steps", "3"],
        ["bench_optimizer.py"],
        ["bench_loader.py", *(["--data", a.data] if a.data else [])],
        ["bench_checkpoint.py"],
        ["bench_recovery.py"],  # needs root: it runs the local cluster
        ["bench_operator_scale.py"],  # 500 jobs on simulated nodes, same local cluster
        ["bench_fleet.py"],  # simulated: writes docs/images/fleet-goodput.png
        # the paper's precision, beta2 and spike-length findings: docs/images/fidelity-*.png
        ["bench_fidelity.py", *(["--data", a.data] if a.data else [])],
    ]
    failed = 0
    for args in runs:
        print(f"\n=== {' '.join(args)}", flush=True)
        failed += subprocess.run([sys.executable, str(HERE / args[0]), *args[1:]]).returncode != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
