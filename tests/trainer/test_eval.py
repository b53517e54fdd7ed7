"""Held-out validation loss in the loop (spec.eval), on CPU: it changes no training number,
bit for bit; a run killed and resumed with it equals an uninterrupted one, its validation losses
included; it falls as the model learns; its time is its own activity, not the steps'."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
from test_resume import run_and_kill_after, run_to_end

from hlat_api import Job
from hlat_trainer.metrics import TrainMetrics
from hlat_trainer.train import Trainer

TRAINING = ("loss", "grad_norm", "param_norm", "lr", "tokens")


def _run(job: Job) -> tuple[Trainer, list[dict[str, object]]]:
    seen: list[dict[str, object]] = []
    trainer = Trainer(job, sinks=[seen.append])
    trainer.run()
    return trainer, seen


def test_evaluation_changes_no_training_number_and_reports_on_its_steps(
        make_job: Callable[..., Job], held_out_data: Path) -> None:
    plain = make_job("plain", train__steps=7, checkpoint__interval=7)
    evaluated = make_job("evaluated", train__steps=7, checkpoint__interval=7,
                         eval={"path": str(held_out_data), "interval": 3, "batches": 2})
    _, without = _run(plain)
    trainer, with_eval = _run(evaluated)
    for key in TRAINING:
        assert [r[key] for r in with_eval] == [r[key] for r in without], key
    # after steps 3 and 6, and after the last (7)
    losses = {r["step"]: r["validation_loss"] for r in with_eval if "validation_loss" in r}
    assert sorted(losses) == [3, 6, 7]
    for r in with_eval:
        if "validation_loss" in r:
            assert r["validation_perplexity"] == pytest.approx(math.exp(r["validation_loss"]))
    # its time is its own activity, and not in the steps' logged time
    spent = trainer.ledger.snapshot()
    assert spent.evaluation > 0
    logged = sum(float(r["step_seconds"]) for r in with_eval)  # type: ignore[arg-type]
    assert spent.productive + spent.data_wait == pytest.approx(logged, rel=0.1)
    # the same micro-batches each time: two evaluations of one model agree exactly
    again = trainer.evaluate()
    assert again == losses[7]
    # an eager backend compiles nothing: its evaluations are never reported as compiling
    assert not trainer.backend.compiles


def test_the_held_out_loss_is_the_mean_token_loss_of_the_held_out_batches(
        make_job: Callable[..., Job], held_out_data: Path) -> None:
    job = make_job(train__steps=2, eval={"path": str(held_out_data), "batches": 3})
    trainer = Trainer(job)
    import torch

    with torch.no_grad():
        by_hand = sum(float(trainer.backend.loss(trainer.model(x), y))
                      for x, y in trainer.eval_batches) / 3
    assert len(trainer.eval_batches) == 3
    assert trainer.evaluate() == pytest.approx(by_hand, rel=1e-6)
    assert trainer.model.training, "the model is back in training mode"


@pytest.mark.slow
def test_a_killed_and_resumed_run_with_evaluation_equals_an_uninterrupted_one(
        write_config: Callable[..., Path], held_out_data: Path, tmp_path: Path) -> None:
    n = 4
    config = write_config(train__steps=2 * n, checkpoint__interval=n,
                          eval={"path": str(held_out_data), "interval": 2, "batches": 2})
    straight = run_to_end(config, tmp_path / "a")
    before = run_and_kill_after(config, tmp_path / "b", n)
    after = run_to_end(config, tmp_path / "b")
    assert after[0]["step"] == n + 1
    resumed = before[:n] + after
    for key in ("loss", "gradNorm", "paramNorm", "validationLoss"):
        assert [r.get(key) for r in resumed] == [r.get(key) for r in straight], key
    assert [r["step"] for r in straight if "validationLoss" in r] == [2, 4, 6, 8]


@pytest.mark.slow
def test_the_validation_loss_falls_as_the_model_learns(
        make_job: Callable[..., Job], held_out_data: Path) -> None:
    """From near uniform (ln 4096 = 8.3) after step 2 to well below by step 40: held-out
    stdlib pieces share the training pieces' unigram statistics. (The set's 8 sequences come
    from 8 documents, one lane each, as a step's are: 274 distinct tokens. Read as one stream,
    as before 2026-11-29, they came from one or two, 167 distinct tokens, and the loss fell
    by more: 1.0 then, 0.84 now.)"""
    job = make_job(train__steps=40, train__globalBatch=8, optimizer__warmupSteps=5,
                   checkpoint__interval=40,
                   eval={"path": str(held_out_data), "interval": 2, "batches": 4})
    _, seen = _run(job)
    losses = [r["validation_loss"] for r in seen if "validation_loss" in r]
    assert len(losses) == 20
    assert losses[0] == pytest.approx(8.3, abs=0.4)
    assert max(losses[-3:]) < losses[0] - 0.6, losses


def test_the_validation_loss_is_a_prometheus_gauge() -> None:
    metrics = TrainMetrics()
    metrics.update({"step": 3, "loss": 5.0, "validation_loss": 4.25})
    assert metrics.registry.get_sample_value("hlat_train_validation_loss") == 4.25
    metrics.update({"step": 4, "loss": 4.9})  # a step without evaluation keeps the last value
    assert metrics.registry.get_sample_value("hlat_train_validation_loss") == 4.25


def test_a_missing_held_out_set_is_an_error_naming_eval_path(
        make_job: Callable[..., Job], tmp_path: Path) -> None:
    from hlat_trainer.errors import UserError

    job = make_job(eval={"path": str(tmp_path / "nowhere")})
    with pytest.raises(UserError, match=r"eval\.path") as info:
        Trainer(job)
    assert "data.path" not in str(info.value)
