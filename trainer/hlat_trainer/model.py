"""The LLaMA-style decoder HLAT trains: a pure nn.Module, no distributed code.

Design choices (paper sections 3.1, 3.5, 4.3):
- Pre-norm RMSNorm, SwiGLU MLP, rotary position embeddings (rotate-half convention, the same as
  Hugging Face's Llama, so weights map one to one), grouped-query attention.
- Coalesced layers: one fused QKV projection and one fused gate/up projection. Their output
  rows are laid out so that a contiguous split of dim 0 hands each tensor-parallel rank whole
  units: QKV rows are grouped per key/value head as [q heads of the group, k, v]; gate/up rows
  alternate (gate_i, up_i). Tensor parallelism (hlat_trainer.parallel) can then shard these
  weights with a plain row split, and this module infers its local head count from the weight.
- Causal attention through SDPA's `is_causal`: no mask tensor is ever materialised.
- Scaled init: the output projections of attention and MLP in layer l (from 1) use
  std / sqrt(2 l); everything else std (0.02); norm weights 1.
- Untied input embedding and output head, no biases (as LLaMA).
- Build on the meta device and call `init_weights()` after placing the module, so large models
  never materialise on the host first.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from hlat_api.presets import ModelDims

INIT_STD = 0.02


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 whatever the activation dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        normed: Tensor = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).type_as(x)
        return normed * self.weight

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos and sin tables of shape [max_seq_len, head_dim] (rotate-half layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate [B, heads, T, head_dim] by the position tables sliced to T."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    out: Tensor = (x * cos + rotated * sin).type_as(x)
    return out


class Attention(nn.Module):
    def __init__(self, dims: ModelDims) -> None:
        super().__init__()
        self.head_dim = dims.head_dim
        self.q_per_kv = dims.heads // dims.kv_heads
        qkv_rows = dims.kv_heads * (self.q_per_kv + 2) * dims.head_dim
        self.wqkv = nn.Linear(dims.hidden_size, qkv_rows, bias=False)
        self.wo = nn.Linear(dims.heads * dims.head_dim, dims.hidden_size, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape
        qkv = self.wqkv(x).view(b, t, -1, self.q_per_kv + 2, self.head_dim)
        # split, not three slices: its backward is one concatenation, where each slice's
        # backward fills a zero gradient the size of qkv and autograd adds the three (eager
        # GPU training spent ~5% of its backward on those fills and adds)
        q, k, v = qkv.split([self.q_per_kv, 1, 1], dim=3)
        q = q.flatten(2, 3).transpose(1, 2)  # [B, H, T, D]
        k, v = k.squeeze(3).transpose(1, 2), v.squeeze(3).transpose(1, 2)  # [B, KV, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.core_attention(q, k, v)
        projected: Tensor = self.wo(out.transpose(1, 2).reshape(b, t, -1))
        return projected

    def core_attention(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal softmax attention; the unit that selective activation checkpointing recomputes."""
        out: Tensor = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.q_per_kv > 1
        )
        return out


class FeedForward(nn.Module):
    """SwiGLU with the gate and up projections fused (rows alternate gate_i, up_i)."""

    def __init__(self, dims: ModelDims) -> None:
        super().__init__()
        self.w_gate_up = nn.Linear(dims.hidden_size, 2 * dims.intermediate_size, bias=False)
        self.w_down = nn.Linear(dims.intermediate_size, dims.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w_gate_up(x).unflatten(-1, (-1, 2)).unbind(-1)  # backward: one stack
        out: Tensor = self.w_down(F.silu(gate) * up)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, dims: ModelDims, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(dims.hidden_size, dims.norm_eps)
        self.attention = Attention(dims)
        self.ffn_norm = RMSNorm(dims.hidden_size, dims.norm_eps)
        self.feed_forward = FeedForward(dims)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        h: Tensor = x + self.attention(self.attention_norm(x), cos, sin)
        out: Tensor = h + self.feed_forward(self.ffn_norm(h))
        return out

    def init_weights(self) -> None:
        out_std = INIT_STD / math.sqrt(2 * (self.layer_id + 1))
        for norm in (self.attention_norm, self.ffn_norm):
            norm.reset_parameters()
        nn.init.normal_(self.attention.wqkv.weight, std=INIT_STD)
        nn.init.normal_(self.feed_forward.w_gate_up.weight, std=INIT_STD)
        nn.init.normal_(self.attention.wo.weight, std=out_std)
        nn.init.normal_(self.feed_forward.w_down.weight, std=out_std)


class Transformer(nn.Module):
    """tokens [B, T] -> logits [B, T, vocab]."""

    rope_cos: Tensor
    rope_sin: Tensor

    def __init__(self, dims: ModelDims) -> None:
        super().__init__()
        self.dims = dims
        self.tok_embeddings = nn.Embedding(dims.vocab_size, dims.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(dims, i) for i in range(dims.layers))
        self.norm = RMSNorm(dims.hidden_size, dims.norm_eps)
        self.output = nn.Linear(dims.hidden_size, dims.vocab_size, bias=False)
        cos, sin = rope_tables(dims.head_dim, dims.max_seq_len, dims.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: Tensor) -> Tensor:
        t = tokens.shape[1]
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits: Tensor = self.output(self.norm(h))
        return logits

    @torch.no_grad()
    def init_weights(self) -> None:
        """Initialise every parameter and buffer in place (after `to_empty` from meta)."""
        cos, sin = rope_tables(self.dims.head_dim, self.dims.max_seq_len, self.dims.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)
        nn.init.normal_(self.tok_embeddings.weight, std=INIT_STD)
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            layer.init_weights()
        self.norm.reset_parameters()
        nn.init.normal_(self.output.weight, std=INIT_STD)


def build_model(dims: ModelDims, device: torch.device | str = "cpu", seed: int = 1) -> Transformer:
    """Build on the meta device, place on `device`, initialise from `seed`."""
    with torch.device("meta"):
        model = Transformer(dims)
    model.to_empty(device=device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.init_weights()
    return model


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
