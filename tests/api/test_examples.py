"""Every file under examples/ is a PretrainJob the API accepts, and the trn1 one is the paper's
recipe: a user copying it gets what the paper ran, not a near miss."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hlat_api import load_job

EXAMPLES = sorted((Path(__file__).parents[2] / "examples").glob("*.yaml"))


def test_the_examples_are_found() -> None:
    names = {p.name for p in EXAMPLES}
    assert {"pretrainjob-tiny.yaml", "pretrainjob-7b-trn1.yaml"} <= names, names


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_is_a_valid_pretrainjob(path: Path) -> None:
    raw = yaml.safe_load(path.read_text())
    assert (raw["apiVersion"], raw["kind"]) == ("hlat.dev/v1alpha1", "PretrainJob")
    job = load_job(path)  # raises InvalidSpecError naming the field otherwise
    assert job.name == raw["metadata"]["name"]
    # a Kubernetes job's checkpoints live on the shared volume, not in a container's filesystem
    storage = job.spec.storage
    assert storage.claim_name and job.spec.checkpoint.dir.startswith(storage.mount_path + "/")


def test_the_trn1_example_is_the_papers_run() -> None:
    spec = load_job(Path(__file__).parents[2] / "examples" / "pretrainjob-7b-trn1.yaml").spec
    # section 3.5: 64 trn1.32xlarge, TP 8 with SP, PP 1, DP 256; section 3.2: hyperparameters
    assert (spec.nodes, spec.instance_type, spec.model.preset) == (64, "trn1.32xlarge", "7b")
    p = spec.parallelism
    assert (p.tensor, p.pipeline, p.sequence_parallel, p.zero1) == (8, 1, True, True)
    assert p.activation_checkpointing == "selective" and spec.precision == "bf16-sr"
    assert (spec.world_size, spec.data_parallel) == (2048, 256)
    assert (spec.data.seq_len, spec.train.global_batch) == (4096, 1024)
    assert spec.tokens_per_step == 4_194_304 and spec.total_steps == 429_154  # 1.8T tokens
    o = spec.optimizer
    assert (o.lr, o.min_lr, o.betas, o.weight_decay, o.grad_clip, o.warmup_steps) == (
        3e-4, 3e-5, (0.9, 0.95), 0.1, 1.0, 2000)
    assert spec.image is None  # the chart's operator.trainerImage, pushed per the README
