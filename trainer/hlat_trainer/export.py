"""`hlat-export --config FILE [--step N] --out DIR [--dtype D]`: a durable checkpoint as a
Hugging Face Llama directory, which lm-evaluation-harness (`--model hf --model_args
pretrained=DIR`), `transformers` and vLLM load as they are.

Our decoder is a LLaMA (tests/trainer/test_model.py: the same logits as `LlamaForCausalLM`)
with two layouts fused for speed, which the export takes apart (`hf_state_dict`): each layer's
`wqkv` holds, per key-value head, its query heads, then its key, then its value (HF: separate
`q_proj`, `k_proj`, `v_proj`, query heads in the same order, so grouped-query attention pairs
them alike), and `w_gate_up` alternates gate and up rows (HF: `gate_proj`, `up_proj`). RoPE is
already in the rotate-half layout HF uses: no permutation. The directory holds `config.json`
(LlamaForCausalLM, the model's dims, `torch_dtype`), `model.safetensors`, and the run's
tokenizer (`tokenizer.json` with a `tokenizer_config.json` naming its end-of-document token);
the byte tokenizer has no HF form and is refused. The checkpoint is read in one process and held
against retention while read, as `hlat-eval` reads it (a torch-native backend's checkpoint, or
the neuron-xla stack's NxD one: `hlat_trainer.nxd_checkpoint`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from hlat_api import Env, ExitCode, InvalidSpecError, PretrainJobSpec, load_job
from hlat_api.presets import ModelDims
from hlat_trainer.errors import UserError

log = logging.getLogger("hlat_trainer.export")

WEIGHTS = "model.safetensors"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.")
"""Name segments activation checkpointing and torch.compile put into a model's state dict."""


def hf_state_dict(ours: Mapping[str, Tensor], dims: ModelDims) -> dict[str, Tensor]:
    """Our model's state dict (`Transformer.state_dict()`) under HF LlamaForCausalLM's names
    and layouts (see the module doc)."""
    plain = {unwrapped(k): v for k, v in ours.items()}
    d, group, h = dims.head_dim, dims.heads // dims.kv_heads, dims.hidden_size
    out = {"model.embed_tokens.weight": plain["tok_embeddings.weight"],
           "model.norm.weight": plain["norm.weight"],
           "lm_head.weight": plain["output.weight"]}
    for i in range(dims.layers):
        mine, theirs = f"layers.{i}.", f"model.layers.{i}."
        qkv = plain[mine + "attention.wqkv.weight"].view(dims.kv_heads, group + 2, d, h)
        gate_up = plain[mine + "feed_forward.w_gate_up.weight"]
        out.update({
            theirs + "self_attn.q_proj.weight": qkv[:, :group].reshape(-1, h),
            theirs + "self_attn.k_proj.weight": qkv[:, group].reshape(-1, h),
            theirs + "self_attn.v_proj.weight": qkv[:, group + 1].reshape(-1, h),
            theirs + "self_attn.o_proj.weight": plain[mine + "attention.wo.weight"],
            theirs + "mlp.gate_proj.weight": gate_up[0::2],
            theirs + "mlp.up_proj.weight": gate_up[1::2],
            theirs + "mlp.down_proj.weight": plain[mine + "feed_forward.w_down.weight"],
            theirs + "input_layernorm.weight": plain[mine + "attention_norm.weight"],
            theirs + "post_attention_layernorm.weight": plain[mine + "ffn_norm.weight"],
        })
    return {k: v.contiguous() for k, v in out.items()}


def unwrapped(name: str) -> str:
    """A model state dict's name without the segments of `_WRAPPERS`."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    return name


def hf_config(dims: ModelDims, dtype: str, eos_id: int) -> dict[str, Any]:
    """config.json of a LlamaForCausalLM with our model's dims."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": dims.vocab_size, "hidden_size": dims.hidden_size,
        "intermediate_size": dims.intermediate_size, "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads, "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim, "max_position_embeddings": dims.max_seq_len,
        "rope_theta": dims.rope_theta, "rms_norm_eps": dims.norm_eps, "hidden_act": "silu",
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": dtype, "eos_token_id": eos_id,
    }
    return config


def export(spec: PretrainJobSpec, job: str, entry: Any, out: Path, dtype: str = "float32"
           ) -> Path:
    """Write the checkpoint at `entry` to `out` as a HF Llama directory (see the module doc)."""
    from safetensors.torch import save_file

    from hlat_trainer.data.tokenizer import BYTES_SPEC, load_tokenizer
    from hlat_trainer.evaluate import load

    if spec.data.tokenizer == BYTES_SPEC:
        raise UserError("data.tokenizer is `bytes`, which has no Hugging Face form: export the "
                        "checkpoint of a run with a tokenizer file")
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: one of {', '.join(DTYPES)}")
    engine, _ = load(spec, job, entry, held_out=False)
    dims = spec.model.dims()
    tensors = {k: v.detach().to("cpu", DTYPES[dtype])
               for k, v in hf_state_dict(engine.model.state_dict(), dims).items()}
    tokenizer = load_tokenizer(spec.data.tokenizer)
    eos, eos_token = tokenizer.eos_id, getattr(tokenizer, "eos_token", None)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(dims, dtype, eos), indent=2) + "\n")
    shutil.copyfile(spec.data.tokenizer, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": dims.max_seq_len,
        **({"eos_token": eos_token} if eos_token else {}),
    }, indent=2) + "\n")
    log.info("step_%d exported to %s (%s, %d tensors)", entry.step, out, dtype, len(tensors))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hlat-export", description=__doc__.splitlines()[0])
    p.add_argument("--config", default=os.environ.get(Env.CONFIG),
                   help=f"PretrainJob manifest or spec, YAML or JSON (default: ${Env.CONFIG})")
    p.add_argument("--job-name", default=os.environ.get(Env.JOB_NAME),
                   help="job name of the checkpoint directory (default: metadata.name)")
    p.add_argument("--step", type=int, default=None,
                   help="the checkpoint's step (default: the newest complete one)")
    p.add_argument("--out", required=True, help="the directory to write")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="the weights' dtype in the export (default: float32)")
    args = p.parse_args(argv)
    if not args.config:
        p.error(f"--config is required (or set ${Env.CONFIG})")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from hlat_trainer.evaluate import choose

    try:
        job = load_job(args.config, name=args.job_name)
        entry = choose(job.spec.checkpoint.dir, job.name, args.step)
        export(job.spec, job.name, entry, Path(args.out), args.dtype)
    except (InvalidSpecError, UserError) as err:
        print(f"hlat-export: {err}", file=sys.stderr)
        return ExitCode.CONFIG_ERROR
    finally:
        from hlat_trainer.distributed import shutdown

        shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
