"""The torch-xla tier (`make test-xla`, run by .venv-xla's pytest; the main suite ignores this
directory): real torch-xla on PJRT's CPU device, the trainer's job fixtures shared."""

import os
import sys
from pathlib import Path

# before anything imports torch_xla: PJRT picks its device when the runtime starts
os.environ.setdefault("PJRT_DEVICE", "CPU")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "trainer"))

from jobfixtures import held_out_data, make_job, sample_data, write_config

__all__ = ["held_out_data", "make_job", "sample_data", "write_config"]
