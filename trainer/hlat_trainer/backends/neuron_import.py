"""Importing the Neuron stack (torch-xla's Neuron build, torch-neuronx, neuronx-distributed),
with an error that says where to get it: a leaf both `neuron_xla` (the backend) and `nxd_model`
(the NxD model, which the backend builds) import, so neither imports the other at load time."""

from __future__ import annotations

import importlib
from types import ModuleType

from hlat_trainer.errors import UserError

NEURON_IMAGE = "public.ecr.aws/neuron/pytorch-training-neuronx:2.9.0-neuronx-py312-sdk2.30.0-ubuntu24.04"
_PACKAGES = {"torch_xla": "torch-xla (Neuron build)", "torch_neuronx": "torch-neuronx",
             "neuronx_distributed": "neuronx-distributed"}


def require_neuron(module: str) -> ModuleType:
    """Import a Neuron-stack module, or raise a UserError that says where to get it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        package = _PACKAGES.get(module.split(".")[0], module.split(".")[0])
        raise UserError(
            f"backend neuron-xla needs the `{package}` package (module {module} is missing), "
            "which is not on PyPI: run in the trainer image built FROM "
            f"{NEURON_IMAGE} (Dockerfile.trainer), or install it from the Neuron pip "
            "repository; off Trainium set backend: cpu or cuda"
        ) from err
