"""A trainer that meets a Neuron hardware error exits `ExitCode.NODE_FAULT`: the operator
moves the job off that node (no restart budget) instead of restarting it on the same device."""

from __future__ import annotations

from pathlib import Path

import pytest

from hlat_api import Env, ExitCode
from hlat_trainer import cli
from hlat_trainer.neuron_env import neuron_device_error


@pytest.mark.parametrize(("message", "found"), [
    ("nrt_execute status=1201 NRT_EXEC_HW_ERR_HBM_UE", "NRT_EXEC_HW_ERR_HBM_UE"),
    ("RuntimeError: ... NRT_EXEC_HW_ERR_DMA_ABORT (1203)", "NRT_EXEC_HW_ERR_DMA_ABORT"),
    ("nrt_init failed: NRT_HW_ERROR", "NRT_HW_ERROR"),
    ("kernel: NEURON_HW_ERR=DMA_ERROR affecting neuron devices", "NEURON_HW_ERR="),
    ("NRT_TIMEOUT: execution timed out", None),  # not the hardware's word: a process fault
    ("CUDA out of memory", None),
])
def test_which_errors_name_a_neuron_device_fault(message: str, found: str | None) -> None:
    assert neuron_device_error(message) == found


@pytest.mark.parametrize(("error", "expected"), [
    (RuntimeError("Bad status from nrt_execute: NRT_EXEC_HW_ERR_NC_UE"), ExitCode.NODE_FAULT),
    (RuntimeError("an ordinary bug"), None),  # raised: torchrun reports 1, a process fault
])
def test_the_trainer_exits_node_fault_on_a_device_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception,
        expected: int | None) -> None:
    exit_file = tmp_path / "exit-code"
    monkeypatch.setenv(Env.EXIT_FILE, str(exit_file))

    def boom(*_: object) -> int:
        raise error

    monkeypatch.setattr(cli, "_run", boom)
    if expected is None:
        with pytest.raises(RuntimeError):
            cli.main(["--config", str(tmp_path / "job.yaml")])
        assert not exit_file.exists()
        return
    assert cli.main(["--config", str(tmp_path / "job.yaml")]) == expected
    # hlat-launch reads it: torchrun itself would report the worker's exit as 1
    assert exit_file.read_text() == str(int(expected))


@pytest.mark.parametrize(("written", "codes", "expected"), [
    ("4", [1, None], ExitCode.NODE_FAULT),  # the in-place agent ends the pod: off the node
    ("2", [1, None], ExitCode.CONFIG_ERROR),
    (None, [1, None], 1),
    (None, [-9], 137),
])
def test_the_in_place_agent_reports_the_code_a_worker_left(
        tmp_path: Path, written: str | None, codes: list[int | None], expected: int) -> None:
    from hlat_trainer import agent

    exit_file = tmp_path / "exit-code"
    if written is not None:
        exit_file.write_text(written)
    assert agent._exit_code(codes, exit_file) == expected
