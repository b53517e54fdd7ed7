"""bench/ is a folder of scripts, not a package: its modules (report, run_all) import from it."""

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
