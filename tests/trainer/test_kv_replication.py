"""Tensor parallelism beyond the kv-head count on the torch-native path (70B: 8 kv heads at
tp 32): kv heads replicated, the same model as at tp 1."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_distributed import layout, run, torchrun
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from hlat_api.presets import ModelDims
from hlat_trainer.model import build_model
from hlat_trainer.parallel import replicate_kv_rows

DIMS = ModelDims(64, 2, 8, 2, 192, 512, 128)  # 8 heads, 2 kv heads


def test_the_replicated_layout_computes_what_the_canonical_one_does() -> None:
    """Each kv group split into m groups of q heads with their own copy of k and v: same
    attention, as a model whose kv heads number kvHeads x m."""
    model = build_model(DIMS, seed=3)
    tokens = torch.randint(0, DIMS.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    expected = model(tokens)
    for layer in model.layers:
        attn = layer.attention
        new = replicate_kv_rows(attn.wqkv.weight.detach(), DIMS.kv_heads, attn.q_per_kv,
                                DIMS.head_dim, 4)
        assert new.shape[0] == 2 * 4 * (1 + 2) * DIMS.head_dim
        attn.wqkv.weight = torch.nn.Parameter(new)
        attn.q_per_kv //= 4
    torch.testing.assert_close(model(tokens), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_tp_beyond_the_kv_heads_trains_like_tp_1(write_config: Callable[..., Path]) -> None:
    """8 heads, 2 kv heads: tp 4 (each kv head on 2 ranks) with sequence parallel gives the
    same losses and gradient norms as one rank, step after step (fp32 round-off only: the
    largest relative difference seen was 7e-8)."""
    model = {"preset": "tiny", "hiddenSize": 64, "layers": 2, "heads": 8, "kvHeads": 2,
             "intermediateSize": 192, "vocabSize": 4096, "maxSeqLen": 128}
    config = write_config(train__steps=4, train__microBatch=1, train__globalBatch=2,
                          model=model)
    one = run(torchrun(config, 1, *layout(1, 1), "checkpoint.dir=" + str(config.parent / "a")))
    four = run(torchrun(config, 4, *layout(4, 4, **{"parallelism.sequenceParallel": "true"}),
                        "checkpoint.dir=" + str(config.parent / "b")))

    def series(stdout: str, key: str) -> list[float]:
        return [json.loads(x)[key] for x in stdout.splitlines() if x.startswith("{")]

    for key in ("loss", "gradNorm", "paramNorm"):
        base = series(one.stdout, key)
        assert len(base) == 4
        assert series(four.stdout, key) == pytest.approx(base, rel=1e-5), key
    assert len(re.findall(r"updates \d+ of \d+ parameter elements", four.stderr)) == 4
    # the replicas of each kv head are still bit-identical in the saved model
    saved = config.parent / "b4.pt"
    dcp_to_torch_save(config.parent / "b" / "job" / "step_4", saved)
    state = torch.load(saved, weights_only=False)
    head_dim, q_local = 64 // 8, 8 // 4
    weights = [v for k, v in state["model"].items() if k.endswith("wqkv.weight")]
    assert len(weights) == 2
    for w in weights:
        groups = w.view(4, q_local + 2, head_dim, -1)  # one group per tp rank
        for kv in range(2):  # ranks 2kv and 2kv+1 hold kv head kv
            assert torch.equal(groups[2 * kv, q_local:], groups[2 * kv + 1, q_local:])
