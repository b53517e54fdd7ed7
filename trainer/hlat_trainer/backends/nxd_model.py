"""The HLAT decoder built from neuronx-distributed (NxD) parallel layers, for the neuron-xla backend.

The math is `hlat_trainer.model`'s, layer for layer (RMSNorm in fp32, RoPE rotate-half, GQA,
SwiGLU, scaled init std/sqrt(2l), untied head); only the linear layers and the embedding are
NxD's tensor-parallel ones, as in NxD's LLaMA example (examples/training/llama/
modeling_llama_nxd.py, neuron-eks.md "neuronx-distributed"):

- Fused QKV: a `ColumnParallelLinear(gather_output=False)` over model.py's row layout, which is
  grouped per key/value head ([q heads of the group, k, v]). NxD splits the output rows
  contiguously, so each tensor-parallel rank gets whole kv groups: the same sharding as the
  torch-native path, and the same weights (a row slice of model.py's).
- Tensor parallelism beyond the kv-head count (70B: 8 kv heads, tp 32): NxD's
  `GQAQKVColumnParallelLinear(kv_size_multiplier=tp / kvHeads)` replicates each kv head on
  that many ranks, sums the replicas' gradients over its kv groups, and returns (q, k, v)
  (modules/qkv_linear.py). Each rank then holds heads/tp query heads and one kv head. Which
  query heads share a kv head follows NxD's replica layout (it differs between trn1 and trn2),
  a relabelling of heads: the same model family, but not model.py's weight layout, so such a
  model does not map one to one onto model.py's (its checkpoints are NxD's own anyway).
- Fused gate/up: `ColumnParallelLinear(gather_output=False)`; rows alternate (gate_i, up_i), so
  a contiguous split hands each rank whole pairs. wo and w_down: `RowParallelLinear(
  input_is_parallel=True)`. Embedding: `ParallelEmbedding` (vocab-sharded). Head:
  `ColumnParallelLinear(gather_output=False)`: vocab-parallel logits for `parallel_cross_entropy`.
- Sequence parallel (paper 3.5): every layer gets `sequence_parallel_enabled=True` and the norm
  weights carry the attribute `sequence_parallel_enabled` (so NxD all-reduces their gradients
  over the TP group). NxD's convention then is sequence-first activations: the embedding
  transposes to [T, B, H] and reduce-scatters T; column layers all-gather T; row layers
  reduce-scatter T (parallel_layers/layers.py). Attention therefore transposes to
  [B, heads, T, D] around the core and back.
- `CoreAttention` is its own module, so selective activation checkpointing can name it
  (`activation_checkpoint_config=CoreAttention`); full checkpointing names `NxDDecoderLayer`
  (NxD's string "full" only knows HF and NxDT models: trainer/trainer.py). The attention core
  is written as NxD's example writes it (explicit scores, triu mask, fp32 softmax), which is what
  neuronx-cc is known to compile, rather than SDPA.

Never run: neuronx_distributed is not installable here. Imported only by neuron_xla.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from hlat_api.presets import ModelDims
from hlat_trainer.backends.neuron_import import require_neuron
from hlat_trainer.model import INIT_STD, RMSNorm, apply_rope, rope_tables


def _normal(std: float) -> Any:
    return partial(nn.init.normal_, mean=0.0, std=std)


def _layers() -> Any:
    return require_neuron("neuronx_distributed.parallel_layers.layers")


def _tp_size() -> int:
    ps = require_neuron("neuronx_distributed.parallel_layers.parallel_state")
    return int(ps.get_tensor_model_parallel_size())


def _sp_norm(dims: ModelDims, sequence_parallel: bool) -> RMSNorm:
    norm = RMSNorm(dims.hidden_size, dims.norm_eps)
    # NxD all-reduces the grads of weights with this attribute over the TP group (SP norms)
    norm.weight.sequence_parallel_enabled = sequence_parallel  # type: ignore[attr-defined]
    return norm


class CoreAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + causal) v for [B, heads, T, D]; k, v have the kv heads."""

    def __init__(self, q_per_kv: int) -> None:
        super().__init__()
        self.q_per_kv = q_per_kv

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if self.q_per_kv > 1:  # query head h uses kv head h // q_per_kv, as SDPA's enable_gqa
            k = k.repeat_interleave(self.q_per_kv, dim=1)
            v = v.repeat_interleave(self.q_per_kv, dim=1)
        t = q.shape[-2]
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(q.shape[-1])
        causal = torch.triu(torch.ones(t, t, device=q.device, dtype=torch.bool), diagonal=1)
        scores = scores.masked_fill(causal, torch.finfo(scores.dtype).min)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.matmul(probs, v)


def kv_size_multiplier(dims: ModelDims, tp: int) -> int:
    """How many ranks hold each kv head: tp / kvHeads when tp exceeds it, else 1."""
    return max(1, tp // dims.kv_heads)


class NxDAttention(nn.Module):
    def __init__(self, dims: ModelDims, layer_id: int, sp: bool, dtype: torch.dtype) -> None:
        super().__init__()
        L, tp = _layers(), _tp_size()
        self.sp, self.head_dim = sp, dims.head_dim
        out_std = INIT_STD / math.sqrt(2 * (layer_id + 1))
        multiplier = kv_size_multiplier(dims, tp)
        self.replicated_kv = multiplier > 1
        if self.replicated_kv:
            qkv = require_neuron("neuronx_distributed.modules.qkv_linear")
            self.wqkv = qkv.GQAQKVColumnParallelLinear(
                dims.hidden_size, [dims.heads * dims.head_dim, dims.kv_heads * dims.head_dim],
                bias=False, gather_output=False, dtype=dtype, init_method=_normal(INIT_STD),
                sequence_parallel_enabled=sp, kv_size_multiplier=multiplier)
            self.q_per_kv = (dims.heads // tp) // (dims.kv_heads * multiplier // tp)
        else:
            self.q_per_kv = dims.heads // dims.kv_heads
            qkv_rows = dims.kv_heads * (self.q_per_kv + 2) * dims.head_dim
            self.wqkv = L.ColumnParallelLinear(
                dims.hidden_size, qkv_rows, bias=False, gather_output=False, dtype=dtype,
                init_method=_normal(INIT_STD), sequence_parallel_enabled=sp)
        self.wo = L.RowParallelLinear(
            dims.heads * dims.head_dim, dims.hidden_size, bias=False, input_is_parallel=True,
            dtype=dtype, init_method=_normal(out_std), sequence_parallel_enabled=sp)
        self.core_attention = CoreAttention(self.q_per_kv)

    def _heads(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, local heads, T, D] and k, v [B, local kv heads, T, D] of the input."""
        def batch_first(t: Tensor) -> Tensor:  # [T, B, rows] under SP
            return t.transpose(0, 1) if self.sp else t

        def split(t: Tensor) -> Tensor:
            return t.reshape(*t.shape[:-1], -1, self.head_dim).transpose(1, 2)

        if self.replicated_kv:
            q, k, v = (batch_first(t) for t in self.wqkv(x))
            return split(q), split(k), split(v)
        qkv = batch_first(self.wqkv(x))
        qkv = qkv.reshape(*qkv.shape[:-1], -1, self.q_per_kv + 2, self.head_dim)
        q = qkv[:, :, :, : self.q_per_kv].flatten(2, 3).transpose(1, 2)
        return q, qkv[:, :, :, self.q_per_kv].transpose(1, 2), qkv[
            :, :, :, self.q_per_kv + 1].transpose(1, 2)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        q, k, v = self._heads(x)
        b, t = q.shape[0], q.shape[2]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core_attention(q, k, v).transpose(1, 2).reshape(b, t, -1)
        if self.sp:
            out = out.transpose(0, 1).contiguous()
        projected: Tensor = self.wo(out)
        return projected


class NxDFeedForward(nn.Module):
    def __init__(self, dims: ModelDims, layer_id: int, sp: bool, dtype: torch.dtype) -> None:
        super().__init__()
        L = _layers()
        out_std = INIT_STD / math.sqrt(2 * (layer_id + 1))
        self.w_gate_up = L.ColumnParallelLinear(
            dims.hidden_size, 2 * dims.intermediate_size, bias=False, gather_output=False,
            dtype=dtype, init_method=_normal(INIT_STD), sequence_parallel_enabled=sp)
        self.w_down = L.RowParallelLinear(
            dims.intermediate_size, dims.hidden_size, bias=False, input_is_parallel=True,
            dtype=dtype, init_method=_normal(out_std), sequence_parallel_enabled=sp)

    def forward(self, x: Tensor) -> Tensor:
        gate_up = self.w_gate_up(x).unflatten(-1, (-1, 2))
        out: Tensor = self.w_down(nn.functional.silu(gate_up[..., 0]) * gate_up[..., 1])
        return out


class NxDDecoderLayer(nn.Module):
    """The unit of full activation checkpointing."""

    def __init__(self, dims: ModelDims, layer_id: int, sp: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.attention_norm = _sp_norm(dims, sp)
        self.attention = NxDAttention(dims, layer_id, sp, dtype)
        self.ffn_norm = _sp_norm(dims, sp)
        self.feed_forward = NxDFeedForward(dims, layer_id, sp, dtype)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h: Tensor = x + self.attention(self.attention_norm(x), cos, sin)
        out: Tensor = h + self.feed_forward(self.ffn_norm(h))
        return out


class NxDTransformer(nn.Module):
    """tokens [B, T] -> vocab-parallel logits [B, T, vocab / tp]."""

    rope_cos: Tensor
    rope_sin: Tensor
    init_seed: int = 0
    """The seed `init_module` restarts from (build_nxd_model sets it)."""

    def __init__(self, dims: ModelDims, *, sequence_parallel: bool,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        L, sp = _layers(), sequence_parallel
        if dims.vocab_size % _tp_size():
            raise ValueError(f"vocab size {dims.vocab_size} must divide by the TP degree")
        self.dims, self.sp = dims, sp
        self.tok_embeddings = L.ParallelEmbedding(
            dims.vocab_size, dims.hidden_size, init_method=_normal(INIT_STD), dtype=dtype,
            sequence_parallel_enabled=sp)
        self.layers = nn.ModuleList(
            NxDDecoderLayer(dims, i, sp, dtype) for i in range(dims.layers))
        self.norm = _sp_norm(dims, sp)
        self.output = L.ColumnParallelLinear(
            dims.hidden_size, dims.vocab_size, bias=False, gather_output=False, dtype=dtype,
            init_method=_normal(INIT_STD), sequence_parallel_enabled=sp)
        cos, sin = rope_tables(dims.head_dim, dims.max_seq_len, dims.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        h = self.tok_embeddings(tokens)  # [B, T, H], or [T / tp, B, H] under SP
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits: Tensor = self.output(self.norm(h))  # SP: the head all-gathers T -> [T, B, V/tp]
        return logits.transpose(0, 1) if self.sp else logits


def build_nxd_model(dims: ModelDims, sequence_parallel: bool, seed: int,
                    dtype: torch.dtype) -> NxDTransformer:
    """The model function handed to `nxd.initialize_parallel_model` (which moves it to XLA);
    the parallel layers are built in `dtype`, as NxD's LLaMA passes `config.torch_dtype`."""
    torch.manual_seed(seed)
    model = NxDTransformer(dims, sequence_parallel=sequence_parallel, dtype=dtype)
    model.init_seed = seed
    return model


def init_module(module: nn.Module, device: torch.device) -> None:
    """NxD's `param_init_fn` under meta-device init: called for every module (the root first)
    once its own parameters are empty on `device` (utils/model_utils.py reinit_model 220-229).

    NxD's parallel layers draw each weight whole and keep their slice (layers.py
    `init_weight_cpu`, GQA: qkv_linear.py `initialize_weight_biases`), so reseeding at the root
    and visiting the modules in the order they were built draws what a CPU build draws: the
    same weights at every tp degree, as NxD's LLaMA `init_weights` (modeling_llama_nxd.py 870)."""
    if isinstance(module, NxDTransformer):
        torch.manual_seed(module.init_seed)
    if isinstance(module, RMSNorm):
        module.weight.data.fill_(1.0)
    else:  # NxD's classes, known here only by their methods (imported lazily elsewhere)
        init = getattr(module, "init_weight_cpu", None) or getattr(
            module, "initialize_weight_biases", None)
        if callable(init):
            init()
