"""Plain PyTorch on a torch device: CPU (gloo), CUDA (NCCL) and Neuron's native device.

These three differ only in the device, the process-group backend and the autocast device type;
the model is `hlat_trainer.model.Transformer`, parallelised by `hlat_trainer.parallel` and
checkpointed by `hlat_trainer.checkpoint`, the same code on all three. Nothing per step: eager
execution needs no graph cut.

`neuron-native` is TorchNeuron (PyTorch >= 2.10, beta from Neuron 2.33 on trn2/trn3): device
`neuron`, process-group backend `neuron`, `torch.autocast(device_type="neuron")`, DTensor/FSDP2
supported (Neuron docs: torch/index.rst, torch/guides/torch-distributed.rst). Its package
`torch-neuronx` is not on PyPI, so that path has never run here. bf16-sr keeps the software
`AdamWSR` there too: it is exact about what it rounds, and the Neuron docs name no
hardware-SR switch for native eager optimizer steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from hlat_trainer.backends.base import Backend, BackendName
from hlat_trainer.errors import UserError

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from torch import Tensor, nn

    from hlat_api import PretrainJobSpec
    from hlat_trainer.devicetime import StepClock


@dataclass(frozen=True)
class _Stack:
    device_type: str
    dist_backend: str


_STACKS: dict[str, _Stack] = {
    "cpu": _Stack("cpu", "gloo"),
    "cuda": _Stack("cuda", "nccl"),
    # Neuron docs, torch/guides/torch-distributed.rst: init_process_group(backend="neuron"),
    # tensors on torch.device("neuron")
    "neuron-native": _Stack("neuron", "neuron"),
}


class TorchNativeBackend(Backend):
    """cpu, cuda or neuron-native: one class, the stack chosen by `name`."""

    name: BackendName
    dist_backend: str
    autocast_device_type: str
    parallelizes_model: ClassVar[bool] = False

    def __init__(self, spec: PretrainJobSpec, name: BackendName) -> None:
        super().__init__(spec)
        if name not in _STACKS:
            raise ValueError(f"not a torch-native backend: {name!r}")
        stack = _STACKS[name]
        self.name = name
        self.dist_backend = stack.dist_backend
        self.autocast_device_type = stack.device_type

    @property
    def host_timed(self) -> bool:
        return self.name == "cpu"

    def device_clock(self) -> StepClock | None:
        """CUDA: events on the current stream (`devicetime.EventClock`)."""
        if self.name != "cuda":
            return None
        import torch

        from hlat_trainer.devicetime import EventClock

        return EventClock(lambda: torch.cuda.Event(enable_timing=True))  # type: ignore[no-untyped-call]

    def device(self, local_rank: int) -> torch.device:
        import torch

        if self.name == "cpu":
            return torch.device("cpu")
        if self.name == "cuda":
            if not torch.cuda.is_available():
                raise UserError("backend cuda was chosen but no CUDA device is visible: "
                                "run on a GPU node or set backend: cpu")
            dev = torch.device("cuda", local_rank)
            torch.cuda.set_device(dev)
            return dev
        _require_torch_neuronx()
        # one logical NeuronCore per torchrun worker; the docs' examples use the bare device
        # (torch/guides/torch-distributed.rst), the runtime maps workers to cores
        return torch.device("neuron")

    def build_model(self, device: torch.device) -> nn.Module:
        from hlat_trainer.model import build_model
        from hlat_trainer.precision import precision_policy

        model = build_model(self.spec.model.dims(), device, seed=self.spec.train.seed)
        return precision_policy(self.spec.precision).apply(model)

    def build_optimizer(self, params: Iterable[Tensor]) -> torch.optim.Optimizer:
        from hlat_trainer.optim import build_optimizer

        o = self.spec.optimizer
        return build_optimizer(list(params), precision=self.spec.precision, lr=o.lr,
                               betas=o.betas, eps=o.eps, weight_decay=o.weight_decay,
                               seed=self.spec.train.seed)


def _require_torch_neuronx() -> None:
    # importing torch_neuronx registers the `neuron` device and process-group backend
    # (torch/guides/torch-distributed.rst; newer releases also autoload it)
    try:
        import torch_neuronx  # noqa: F401
    except ImportError as err:
        raise UserError(
            "backend neuron-native needs the `torch-neuronx` package (TorchNeuron, PyTorch >= "
            "2.10, Neuron SDK >= 2.33, trn2/trn3), which is not on PyPI: install it from the "
            "Neuron pip repository or use a Neuron native PyTorch image; on a "
            "pytorch-training-neuronx image (torch-xla) set backend: neuron-xla"
        ) from err
