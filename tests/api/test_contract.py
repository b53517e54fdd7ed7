"""The heartbeat encoding and the checkpoint layout both sides rely on."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

from hlat_api import Heartbeat, latest_complete, list_checkpoints, step_dir
from hlat_api.heartbeat import Activity


def test_heartbeat_round_trips_through_annotations() -> None:
    beat = Heartbeat(phase="training", step=120, tokens=4.9e5, loss=2.5, checkpoint_step=100,
                     checkpoint_seconds=1.25,
                     progress_time=dt.datetime(2026, 11, 22, 12, 0, 1, 250000, tzinfo=dt.UTC),
                     activity=Activity(startup=12.5, productive=300.25, final_checkpoint=1.5))
    annotations = beat.to_annotations()
    assert annotations["hlat.dev/step"] == "120" and "hlat.dev/loss" in annotations
    assert json.loads(annotations["hlat.dev/activity"])["productive"] == 300.25
    assert all(isinstance(v, str) for v in annotations.values())
    assert Heartbeat.from_annotations({**annotations, "other/key": "x"}) == beat


def test_foreign_or_malformed_annotations_are_not_trusted() -> None:
    assert Heartbeat.from_annotations(None) is None
    assert Heartbeat.from_annotations({"app": "x"}) is None
    assert Heartbeat.from_annotations({"hlat.dev/step": "many"}) is None
    assert Heartbeat.from_annotations({"hlat.dev/step": "1", "hlat.dev/activity": "{"}) is None
    assert Heartbeat.from_annotations(
        {"hlat.dev/step": "1", "hlat.dev/activity": '{"sleeping": 3}'}) is None


def test_only_checkpoints_with_done_are_complete(tmp_path: Path) -> None:
    for step in (10, 20, 30):
        step_dir(tmp_path, "job", step).mkdir(parents=True)
    (step_dir(tmp_path, "job", 10) / "done").touch()
    (step_dir(tmp_path, "job", 20) / "done").touch()
    (tmp_path / "job" / "step_x").mkdir()
    (tmp_path / "job" / "notes.txt").touch()
    entries = list_checkpoints(tmp_path, "job")
    assert [(e.step, e.complete) for e in entries] == [(10, True), (20, True), (30, False)]
    latest = latest_complete(tmp_path, "job")
    assert latest is not None and latest.step == 20
    assert latest_complete(tmp_path, "other") is None


def test_api_reference_doc_is_current() -> None:
    from hlat_api.reference import render

    doc = Path(__file__).parents[2] / "docs" / "api.md"
    assert doc.read_text() == render(), "run: .venv/bin/python -m hlat_api.reference > docs/api.md"
    assert "`checkpoint.async`" in doc.read_text() and "`data.seqLen`" in doc.read_text()
