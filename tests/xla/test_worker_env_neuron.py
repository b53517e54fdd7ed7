"""In-place workers get their NeuronCores: torch-xla 2.9's own Neuron set-up, run in them.

The side-by-side of tests/trainer/test_worker_env_torchrun.py again, with this tier's torch
(2.9, the Neuron image's: its torchrun is the reference that counts), and each in-place worker
running torch-xla's `configure_pjrt_environment` (torch_xla/_internal/neuron.py:49-89 at
v2.9.0, what `import torch_xla` runs on a Neuron host, torch_xla/__init__.py:119-140). Here it
runs on its own: there is no libneuronxla to trigger it at import, and no NeuronCore to take.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from test_worker_env_torchrun import handlers, side_by_side  # noqa: F401  (fixture)


def test_each_inplace_worker_gets_its_own_neuron_core_and_pjrt_process_index(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, handlers: None) -> None:  # noqa: F811
    ref, ours = side_by_side(tmp_path, monkeypatch, 2, 2, "--neuron")
    for rank, worker in ours.items():
        theirs = ref[rank]["env"]
        assert worker["neuron"] == {
            "NEURON_RT_VISIBLE_CORES": theirs["LOCAL_RANK"],  # not every core of the node
            "NEURON_PJRT_PROCESS_INDEX": theirs["RANK"],
            "NEURON_PJRT_WORLD_SIZE": theirs["WORLD_SIZE"],
            "PJRT_LOCAL_PROCESS_COUNT": theirs["LOCAL_WORLD_SIZE"],
            "PJRT_LOCAL_PROCESS_RANK": theirs["LOCAL_RANK"],
        }, f"rank {rank}"


def test_a_standby_has_not_imported_torch_xla_when_its_attempt_arrives() -> None:
    """The Neuron set-up runs once, at `import torch_xla`, from the environment of that
    moment: a warm standby that imported it while waiting would have run it before the
    attempt's ranks and TORCHELASTIC_RUN_ID arrived (`hlat_trainer.standby`)."""
    code = ("import sys, hlat_trainer.standby as s\n"
            "assert s.main([]) == 0\n"  # prepared, then no attempt (stdin at its end)
            "sys.exit('torch_xla' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL,
                          timeout=300).returncode == 0
