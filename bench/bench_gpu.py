"""On a GPU: the MFU of a ~1B LLaMA trained in bf16 with stochastic rounding, against the card's
bf16 peak and against HF transformers' LlamaForCausalLM in the same run; and `AdamWSR`'s Triton
kernel against torch's fused AdamW on fp32 master weights (issue 16).

Where no CUDA device is present (this project's CI and `make bench` machine have none), it
emits the section recorded by the last run on a GPU (bench/recorded/gpu.json, written with
--record), headed by where and when it was measured: docs/benchmarks.md keeps the GPU figures
without presenting them as figures of the current run.

What runs, each side by side in alternating rounds (order rotated each round), median and
fastest round reported with the spread:
- the card: name, SMs, and a measured bf16 matmul rate (8192^3, random data), so MFU is given
  against the datasheet peak and against what a plain matmul reaches on this card;
- the optimizer, on the 1b preset's parameter shapes: torch's fused AdamW (fp32 params,
  grads and moments: mixed precision's optimizer, the baseline), `AdamWSR` on bf16 weights
  through the Triton kernel, the same through the pure-torch path (HLAT_SR_KERNEL=torch);
- training steps (forward, fp32 loss, backward, optimizer) of our decoder and of HF's
  LlamaForCausalLM (sdpa attention), both the 1b preset in bf16 with `AdamWSR`, same batches.
  MFU counts the model's FLOPs per token as `ModelDims.flops_per_token` (6 x non-embedding
  parameters + the attention scores, PaLM's appendix B) over the step's wall time.

    python bench/bench_gpu.py [--batch 8] [--seq-len 2048] [--rounds 5] [--steps 3] [--compile] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

import report
from hlat_api import MODEL_PRESETS, ModelDims

RECORDED = Path(__file__).resolve().parent / "recorded" / "gpu.json"
KEY, TITLE = "gpu", "On a GPU: MFU of a 1B LLaMA in bf16-SR, and AdamWSR's Triton kernel"
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}
"""Dense bf16 tensor-core peaks from NVIDIA's datasheets (SXM parts), by name fragment."""
MATMUL_N = 8192
OPT_GOAL = 1.0  # AdamWSR step time <= 1.0x torch's fused AdamW (issue 16, on a GPU)


DEVICE = "cuda"


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> float:
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


@dataclass
class Card:
    name: str
    sms: int
    memory_gib: float
    torch: str
    triton: str
    cuda: str
    peak_tflops: float
    """The datasheet's dense bf16 peak (NaN for a card not in PEAK_BF16_TFLOPS)."""
    matmul_tflops: float
    """Measured here: an 8192^3 bf16 matmul on random data, the mean of 10 after 3 warm-ups."""


def card() -> Card:
    import triton

    n = MATMUL_N if DEVICE == "cuda" else 256
    a, b = (torch.randn(n, n, device=DEVICE, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    tflops = 2 * n**3 / (timed(lambda: [a @ b for _ in range(10)]) / 10) / 1e12
    if DEVICE != "cuda":
        return Card("cpu (dry run)", 0, 0.0, torch.__version__, triton.__version__, "-",
                    float("nan"), tflops)
    props = torch.cuda.get_device_properties(0)
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in props.name), float("nan"))
    return Card(props.name, props.multi_processor_count, props.total_memory / 2**30,
                torch.__version__, triton.__version__, str(torch.version.cuda), peak, tflops)


# --- the optimizer ------------------------------------------------------------------------


def optimizer_rounds(dims: ModelDims, rounds: int) -> tuple[dict[str, list[float]],
                                                             dict[str, float], int]:
    """Seconds per step of each variant over the rounds, bytes/param of each, parameters."""
    from bench_optimizer import make_variant, parameter_shapes
    from hlat_trainer.optim import AdamWSR

    hyper = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    shapes = parameter_shapes(dims)
    n_params = sum(torch.Size(s).numel() for s in shapes)
    variants = [
        make_variant("fused", shapes, torch.float32, DEVICE,
                     lambda ps: torch.optim.AdamW(ps, fused=True, **hyper)),
        make_variant("triton", shapes, torch.bfloat16, DEVICE,
                     lambda ps: AdamWSR(ps, seed=0, **hyper)),
        make_variant("torch", shapes, torch.bfloat16, DEVICE,
                     lambda ps: AdamWSR(ps, seed=0, **hyper)),
    ]

    def step(name: str, opt: torch.optim.Optimizer) -> float:
        if name == "torch":
            os.environ["HLAT_SR_KERNEL"] = "torch"
        try:
            return timed(opt.step)
        finally:
            os.environ.pop("HLAT_SR_KERNEL", None)

    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(rounds + 2):  # two warm-up rounds: lazy state, Triton's compile
        shift = r % len(variants)
        for v in variants[shift:] + variants[:shift]:
            elapsed = step(v.name, v.optimizer)
            if r >= 2:
                times[v.name].append(elapsed)
    per_param = {v.name: v.state_bytes() / n_params for v in variants}
    return times, per_param, n_params


# --- training steps: our decoder vs HF's ---------------------------------------------------


def models(dims: ModelDims) -> dict[str, torch.nn.Module]:
    from bench_model import hf_model
    from hlat_trainer.model import build_model
    from hlat_trainer.precision import precision_policy

    policy = precision_policy("bf16-sr")
    ours = policy.apply(build_model(dims, DEVICE))
    with torch.device(DEVICE):
        torch.manual_seed(0)
        hf = hf_model(dims).to(torch.bfloat16)
    return {"hlat": ours.train(), "hf": hf.train()}


def train_step(model: torch.nn.Module, hf: bool) -> Callable[[torch.Tensor, torch.Tensor], None]:
    from bench_model import step_fn
    from hlat_trainer.optim import AdamWSR

    return step_fn(model, hf, lambda ps: AdamWSR(ps, lr=3e-4, betas=(0.9, 0.95),
                                                 weight_decay=0.1, seed=0))


Training = tuple[dict[str, list[float]], dict[str, float]]


def training_rounds(dims: ModelDims, batch: int, seq_len: int, rounds: int, steps: int,
                    compiled: bool = False) -> Training:
    """Seconds per step (the mean of `steps` steps, per round) and peak GiB of each model;
    `compiled`: both models under torch.compile (compiled in the warm-up step)."""
    built = models(dims)
    if compiled:
        built = {name: torch.compile(m) for name, m in built.items()}
    runs = {name: train_step(m, name == "hf") for name, m in built.items()}
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randint(0, dims.vocab_size, (batch, seq_len + 1), device=DEVICE, generator=gen)
    inputs, targets = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    peak: dict[str, float] = {}
    for name, run in runs.items():  # warm-up, and each model's peak memory
        run(inputs, targets)
        if DEVICE == "cuda":
            torch.cuda.reset_peak_memory_stats()
        run(inputs, targets)
        sync()
        peak[name] = torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else 0.0
    times: dict[str, list[float]] = {name: [] for name in runs}
    names = list(runs)
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            run = runs[name]
            times[name].append(timed(lambda run=run: [run(inputs, targets)  # type: ignore[misc]
                                                      for _ in range(steps)]) / steps)
    return times, peak


# --- the section ----------------------------------------------------------------------------


def training_table(dims: ModelDims, c: Card, train: Training, args: argparse.Namespace,
                   how: str) -> str:
    ttimes, peak = train
    tokens = args.batch * args.seq_len
    flops = dims.flops_per_token(args.seq_len) * tokens
    rows = []
    for name, label in (("hlat", "hlat Transformer"), ("hf", "HF LlamaForCausalLM (sdpa)")):
        med, best = statistics.median(ttimes[name]), min(ttimes[name])
        rows.append([label, f"{tokens / med:,.0f}", f"{tokens / best:,.0f}",
                     report.pct(flops / med / 1e12 / c.peak_tflops),
                     report.pct(flops / best / 1e12 / c.peak_tflops),
                     report.pct(flops / med / 1e12 / c.matmul_tflops),
                     report.pct(report.spread(ttimes[name]), 0), f"{peak[name]:.1f}"])
    ratio_med = statistics.median(ttimes["hf"]) / statistics.median(ttimes["hlat"])
    ratio_best = min(ttimes["hf"]) / min(ttimes["hlat"])
    return (f"### Training step, {how}: {args.preset} preset "
            f"({dims.param_count() / 1e9:.2f}B parameters), bf16 weights, `AdamWSR`\n\n"
            f"Batch {args.batch} x {args.seq_len} tokens ({tokens:,} tokens/step, "
            f"{flops / tokens / 1e9:.2f} GFLOP/token); SDPA attention in both; {args.rounds} "
            f"rounds of {args.steps} steps per model, alternating, after a warm-up step.\n\n"
            + report.table(["model", "tokens/s (median)", "tokens/s (fastest)",
                            "MFU vs datasheet (median)", "MFU vs datasheet (fastest)",
                            "MFU vs measured matmul (median)", "IQR / median",
                            "peak GiB"], rows)
            + f"\n\nOurs / HF tokens/s: {ratio_med:.3f}x median, {ratio_best:.3f}x fastest.")


def build_section(c: Card, dims: ModelDims, opt: tuple[dict[str, list[float]],
                  dict[str, float], int], trains: dict[str, Training],
                  args: argparse.Namespace, when: str, wall_s: float) -> report.Section:
    times, per_param, n_params = opt
    base_med, base_min = statistics.median(times["fused"]), min(times["fused"])
    labels = {"fused": "mixed: torch AdamW (fused=True), fp32 master (baseline)",
              "triton": "bf16-sr: `AdamWSR`, Triton kernel",
              "torch": "bf16-sr: `AdamWSR`, pure-torch path (HLAT_SR_KERNEL=torch)"}
    opt_rows = [[labels[k], f"{1e3 * statistics.median(v):.2f}",
                 f"{statistics.median(v) / base_med:.3f}", f"{1e3 * min(v):.2f}",
                 f"{min(v) / base_min:.3f}", report.pct(report.spread(v), 0),
                 f"{per_param[k]:.1f}", f"{per_param[k] / per_param['fused']:.3f}"]
                for k, v in times.items()]
    goals = [report.verdict(
        f"On a GPU: SR AdamW step time <= {OPT_GOAL}x torch's fused AdamW (fp32 master)",
        {"median": statistics.median(times["triton"]) / base_med,
         "fastest round": min(times["triton"]) / base_min}, lambda r: r <= OPT_GOAL, "{:.3f}x")]
    body = [f"Measured {when} on **{c.name}** ({c.sms} SMs, {c.memory_gib:.0f} GiB), torch "
            f"{c.torch}, Triton {c.triton}, CUDA {c.cuda}; {wall_s:.0f} s in all. A plain "
            f"{MATMUL_N}^3 bf16 matmul ran at **{c.matmul_tflops:.0f} TFLOP/s** here (datasheet "
            f"dense bf16 peak {c.peak_tflops:.0f}).",
            f"### Optimizer step, {args.preset} preset's shapes ({n_params / 1e9:.2f}B parameters)\n\n"
            f"{args.opt_rounds} timed rounds after 2 warm-up rounds, one step of each variant "
            "per round.\n\n" + report.table(
                ["variant", "median ms", "x baseline", "fastest ms", "x baseline",
                 "IQR / median", "bytes/param (weights+grads+state)", "x baseline"], opt_rows)]
    body += [training_table(dims, c, t, args, how) for how, t in trains.items()]
    return report.Section(KEY, TITLE, report.command(), "\n\n".join(body), goals)


def recorded_section(path: Path = RECORDED) -> report.Section:
    """The last GPU run's section, marked as recorded (this machine has no CUDA device): the
    body says so and names the commit that recorded it, each goal's figures say "recorded"."""
    if not path.exists():
        return report.Section(KEY, TITLE, report.command(),
                              "No CUDA device here and no recorded GPU run: no figures.")
    section = report.load(path)
    commit = subprocess.run(["git", "log", "-1", "--format=%h %cs", "--", path.name],
                            cwd=path.parent, capture_output=True, text=True).stdout.strip()
    section.body = ("**Recorded, not measured in this run**: this machine has no CUDA device; "
                    "the figures below are those of the last GPU run, kept in "
                    f"`bench/recorded/{path.name}`"
                    + (f" (committed in {commit})" if commit else "")
                    + ". To refresh them, run `python bench/bench_gpu.py --compile --record` "
                    f"on a machine with a GPU.\n\n{section.body}")
    section.goals = [replace(g, figures=f"recorded GPU run: {g.figures}") for g in section.goals]
    return section


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="1b", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5, help="training rounds per model")
    parser.add_argument("--steps", type=int, default=3, help="training steps per round")
    parser.add_argument("--opt-rounds", type=int, default=20)
    parser.add_argument("--record", action="store_true",
                        help="also write the section to bench/recorded/gpu.json")
    parser.add_argument("--dry-run-on-cpu", action="store_true",
                        help="run every phase on the CPU with the tiny preset (a check of the "
                        "script, not a measurement)")
    parser.add_argument("--skip-training", action="store_true")
    parser.add_argument("--compile", action="store_true",
                        help="also measure both models under torch.compile")
    args = parser.parse_args()
    global DEVICE
    if args.dry_run_on_cpu:
        DEVICE, args.preset, args.batch, args.seq_len = "cpu", "tiny", 2, 64
        args.rounds, args.steps, args.opt_rounds = 2, 1, 4
    elif not torch.cuda.is_available():
        section = recorded_section()
        print(section.markdown())
        report.emit(section)
        return 0
    start = time.monotonic()
    when = report.now()
    dims = MODEL_PRESETS[args.preset]
    c = card()
    print(json.dumps(asdict(c)), flush=True)
    opt = optimizer_rounds(dims, args.opt_rounds)
    print({k: f"{1e3 * statistics.median(v):.2f} ms" for k, v in opt[0].items()}, flush=True)
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    trains: dict[str, Training] = {}
    section = build_section(c, dims, opt, trains, args, when, time.monotonic() - start)
    report.emit(section)  # what is measured so far comes back even if a later phase fails
    phases = [] if args.skip_training else ["eager"] + (["torch.compile"] if args.compile else [])
    for how in phases:
        trains[how] = training_rounds(dims, args.batch, args.seq_len, args.rounds, args.steps,
                                      compiled=how == "torch.compile")
        section = build_section(c, dims, opt, trains, args, when, time.monotonic() - start)
        report.emit(section)
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    print(section.markdown())
    if args.record:
        RECORDED.parent.mkdir(parents=True, exist_ok=True)
        RECORDED.write_text(json.dumps(asdict(section), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
