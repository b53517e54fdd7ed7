"""Device stacks behind one interface (`Backend`), chosen from the spec.

`spec.backend: auto` resolves by instance type: trn* -> neuron-xla (torch-xla +
neuronx-distributed, what the HLAT paper ran and what the pytorch-training-neuronx images
carry), p5 -> cuda, cpu -> cpu. `neuron-native` (TorchNeuron, PyTorch >= 2.10) is AWS's
direction on Trainium but must be asked for by name: it is beta and trn2/trn3 only.

Nothing here imports torch, torch_xla or neuronx_distributed at import time: the concrete
backend module is imported by `select_backend`, and the Neuron packages only when a Neuron
backend is used, so the launcher and CPU tests work without them. See docs/neuron.md.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from hlat_trainer.backends.base import Backend, BackendName

if TYPE_CHECKING:
    from hlat_api import PretrainJobSpec

__all__ = ["Backend", "BackendName", "resolve_backend_name", "select_backend"]

_NATIVE_NEURON_INSTANCES = ("trn2.",)  # TorchNeuron beta: trn2 and trn3 (Neuron docs torch/index.rst)


def resolve_backend_name(spec: PretrainJobSpec) -> BackendName:
    """The backend `spec.backend` names, with `auto` resolved from `spec.instanceType`."""
    if spec.backend != "auto":
        return spec.backend
    instance = spec.instance_type
    if instance.startswith("trn"):
        return "neuron-xla"
    if instance.startswith("p5"):
        return "cuda"
    if instance == "cpu":
        return "cpu"
    raise ValueError(f"no automatic backend for instance type {instance!r}: set spec.backend")


def is_neuron(name: BackendName) -> bool:
    return name.startswith("neuron")


def select_backend(spec: PretrainJobSpec) -> Backend:
    """The backend for this spec; importing its device packages is deferred to first use."""
    name = resolve_backend_name(spec)
    if name == "neuron-xla":
        from hlat_trainer.backends.neuron_xla import NeuronXlaBackend

        return NeuronXlaBackend(spec)
    if name == "neuron-native" and not spec.instance_type.startswith(_NATIVE_NEURON_INSTANCES):
        warnings.warn(
            f"backend neuron-native on {spec.instance_type}: TorchNeuron is documented for "
            "trn2/trn3 only; backend neuron-xla is the supported path on trn1",
            stacklevel=2,
        )
    from hlat_trainer.backends.torch_native import TorchNativeBackend

    return TorchNativeBackend(spec, name)
