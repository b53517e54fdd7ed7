"""Backends: selection from the spec, the torch-native CPU backend for real, and the Neuron
backends' behaviour without their packages (which are not installable here). The NxD model port
is checked against model.py with stand-in layers that behave as NxD's do at TP degree 1."""

from __future__ import annotations

import importlib.util
import socket
import sys
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from nxd_fakes import Calls, fake_modules
from torch import nn

from hlat_api import PretrainJobSpec, parse_spec
from hlat_trainer.backends import Backend, resolve_backend_name, select_backend
from hlat_trainer.backends.torch_native import TorchNativeBackend
from hlat_trainer.errors import UserError
from hlat_trainer.model import build_model
from hlat_trainer.optim import AdamWSR

NEURON_PACKAGES_PRESENT = any(
    importlib.util.find_spec(m) is not None for m in ("torch_xla", "neuronx_distributed"))
needs_no_neuron = pytest.mark.skipif(NEURON_PACKAGES_PRESENT, reason="Neuron packages installed")


def make_spec(instance: str = "cpu", backend: str = "auto", **over: Any) -> PretrainJobSpec:
    raw: dict[str, Any] = {
        "instanceType": instance, "backend": backend,
        "model": {"preset": "tiny", "hiddenSize": 64, "layers": 2, "intermediateSize": 96,
                  "vocabSize": 256, "maxSeqLen": 64},
        "data": {"path": "/data", "tokenizer": "bytes", "seqLen": 16},
        "train": {"globalBatch": 64, "steps": 4, "seed": 3}, "optimizer": {"warmupSteps": 1},
        "precision": "fp32",
    }
    raw.update(over)
    return parse_spec(raw)


# --- selection ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("instance", "backend", "name", "dist_backend", "autocast"), [
    ("trn1.32xlarge", "auto", "neuron-xla", "xla", "xla"),
    ("trn1n.32xlarge", "auto", "neuron-xla", "xla", "xla"),
    ("trn2.48xlarge", "auto", "neuron-xla", "xla", "xla"),
    ("trn2.48xlarge", "neuron-native", "neuron-native", "neuron", "neuron"),
    ("p5.48xlarge", "auto", "cuda", "nccl", "cuda"),
    ("cpu", "auto", "cpu", "gloo", "cpu"),
])
def test_selection(instance: str, backend: str, name: str, dist_backend: str,
                   autocast: str) -> None:
    spec = make_spec(instance, backend)
    chosen = select_backend(spec)
    assert isinstance(chosen, Backend)
    assert resolve_backend_name(spec) == chosen.name == name
    assert (chosen.dist_backend, chosen.autocast_device_type) == (dist_backend, autocast)
    assert chosen.parallelizes_model is (name == "neuron-xla")


def test_neuron_native_off_trn2_warns() -> None:
    with pytest.warns(UserWarning, match="trn2/trn3 only"):
        select_backend(make_spec("trn1.32xlarge", "neuron-native"))


# --- torch-native on CPU, for real --------------------------------------------------------------


def test_cpu_backend_device_process_group_and_noop_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    backend = select_backend(make_spec())
    assert backend.device(local_rank=0) == torch.device("cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                       "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    world = backend.init_world()
    try:
        assert dist.get_backend() == "gloo"
        assert (world.rank, world.size, world.dp, world.tp) == (0, 1, 1, 1)
        assert world.tp_mesh is not None
        t = torch.tensor([2.0])
        dist.all_reduce(t)
        assert t.item() == 2.0
    finally:
        dist.destroy_process_group()
    backend.step_end()  # a no-op: nothing to sync on CPU
    backend.finalize_checkpoint()  # no-op off NxD
    with pytest.raises(NotImplementedError, match=r"hlat_trainer\.checkpoint"):
        layer = nn.Linear(1, 1)
        backend.load_checkpoint("/nowhere", 1, layer, torch.optim.SGD(layer.parameters(), lr=1))


@pytest.mark.parametrize(("precision", "dtype", "optimizer"), [
    ("fp32", torch.float32, torch.optim.AdamW),
    ("bf16-sr", torch.bfloat16, AdamWSR),
])
def test_cpu_backend_builds_a_model_that_trains(precision: str, dtype: torch.dtype,
                                                optimizer: type) -> None:
    backend = select_backend(make_spec(precision=precision))
    model = backend.build_model(backend.device(0))
    opt = backend.build_optimizer(model.parameters())
    assert isinstance(opt, optimizer)
    assert {p.dtype for p in model.parameters()} == {dtype}
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(3):
        with backend.autocast():
            loss = backend.loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        opt.zero_grad()
        backend.step_end()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_autocast_only_for_mixed() -> None:
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    with select_backend(make_spec(precision="mixed")).autocast():
        assert (x @ w).dtype == torch.bfloat16
    with select_backend(make_spec(precision="fp32")).autocast():
        assert (x @ w).dtype == torch.float32


def test_not_a_torch_native_name() -> None:
    with pytest.raises(ValueError, match="not a torch-native backend"):
        TorchNativeBackend(make_spec(), "neuron-xla")


def test_a_cuda_backend_times_steps_with_events_and_a_cpu_one_with_the_host_clock() -> None:
    """CUDA runs ahead of the host: its compute is read from events on the stream (the engine
    then scores the node on the device's time); CPU runs the ops as they are called."""
    from hlat_trainer.devicetime import EventClock

    cuda = TorchNativeBackend(make_spec(), "cuda")
    assert not cuda.host_timed and isinstance(cuda.device_clock(), EventClock)
    cpu = TorchNativeBackend(make_spec(), "cpu")
    assert cpu.host_timed and cpu.device_clock() is None


# --- the Neuron backends without their packages -------------------------------------------------


@needs_no_neuron
def test_neuron_xla_imports_without_the_packages_and_says_what_to_install() -> None:
    import hlat_trainer.backends.neuron_xla as nx
    from hlat_trainer.backends.neuron_import import NEURON_IMAGE

    assert "torch_xla" not in sys.modules and "neuronx_distributed" not in sys.modules
    backend = select_backend(make_spec("trn1.32xlarge", train={"globalBatch": 64, "steps": 4}))
    assert isinstance(backend, nx.NeuronXlaBackend)
    for use in (lambda: backend.device(0), backend.step_end, backend.init_world,
                lambda: backend.build_model(torch.device("cpu")), backend.finalize_checkpoint):
        with pytest.raises(UserError) as err:
            use()
        assert NEURON_IMAGE in str(err.value)
    with pytest.raises(UserError, match="`torch-xla \\(Neuron build\\)`"):
        backend.device(0)
    with pytest.raises(UserError, match="`neuronx-distributed`"):
        backend.build_model(torch.device("cpu"))


@needs_no_neuron
def test_neuron_native_without_torch_neuronx_says_what_to_install() -> None:
    backend = select_backend(make_spec("trn2.48xlarge", "neuron-native",
                                       train={"globalBatch": 64, "steps": 4}))
    with pytest.raises(UserError, match="`torch-neuronx`"):
        backend.device(0)


# --- the NxD model port against model.py --------------------------------------------------------


@pytest.fixture
def fake_nxd(monkeypatch: pytest.MonkeyPatch) -> None:
    """NxD's layers at tp 1, with NxD's recorded signatures (nxd_fakes.py)."""
    modules = fake_modules(Calls())
    import hlat_trainer.backends.nxd_model as nm

    monkeypatch.setattr(nm, "require_neuron", modules.__getitem__)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_nxd_model_matches_model_py(fake_nxd: None, sequence_parallel: bool) -> None:
    from hlat_trainer.backends.nxd_model import NxDTransformer

    dims = make_spec().model.dims()
    reference = build_model(dims, seed=5)
    port = NxDTransformer(dims, sequence_parallel=sequence_parallel)
    port.load_state_dict(reference.state_dict(), strict=True)  # same names, same layout
    assert port.norm.weight.sequence_parallel_enabled is sequence_parallel  # type: ignore[attr-defined]
    tokens = torch.randint(0, dims.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(port(tokens), reference(tokens), rtol=1e-5, atol=1e-5)


def test_nxd_core_attention_is_causal_gqa_sdpa() -> None:
    from hlat_trainer.backends.nxd_model import CoreAttention

    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 10, 8, generator=g)
    k, v = torch.randn(2, 2, 10, 8, generator=g), torch.randn(2, 2, 10, 8, generator=g)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(CoreAttention(q_per_kv=2)(q, k, v), expected)
