"""The trainer trains: loss falls on the sample dataset, metrics are served, checkpoints behave."""

from __future__ import annotations

import contextlib
import json
import logging
import shutil
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from kubernetes.client.exceptions import ApiException

from hlat_api import ExitCode, Job, step_dir
from hlat_trainer import engine, heartbeat, train
from hlat_trainer.devicetime import EventClock
from hlat_trainer.engine import pack, unpack
from hlat_trainer.heartbeat import LeaseHeartbeat
from hlat_trainer.metrics import TrainMetrics
from hlat_trainer.train import Trainer


def collect(job: Job) -> tuple[Trainer, list[dict[str, Any]]]:
    seen: list[dict[str, Any]] = []
    trainer = Trainer(job, sinks=[seen.append])
    trainer.run()
    return trainer, seen


class Recorder:
    """The Lease's place: what the loop hands the heartbeat, in order."""

    def __init__(self) -> None:
        self.beats: list[dict[str, Any]] = []

    def update(self, **fields: Any) -> None:
        self.beats.append(fields)

    def stop(self, phase: str | None = None) -> None:
        self.beats.append({"phase": phase, "stopped": True})


@pytest.mark.slow
def test_loss_falls_on_the_sample_dataset(make_job: Callable[..., Job]) -> None:
    """A few minutes of CPU at most: 80 steps of a small model on stdlib text."""
    job = make_job(train__steps=80, train__globalBatch=8, optimizer__warmupSteps=5,
                   checkpoint__interval=80)
    _, seen = collect(job)
    first, last = seen[0]["loss"], sum(r["loss"] for r in seen[-10:]) / 10
    # from uniform over 4096 tokens (ln 4096 = 8.3) to about the data's unigram entropy (~6.3)
    assert first == pytest.approx(8.3, abs=0.3)
    assert last < first - 1.2, (first, last)
    assert all(r["tokens_per_second"] > 0 and 0 < r["mfu"] < 1 for r in seen)


def test_steps_count_from_one_and_checkpoints_hold_the_state_after_n_steps(
    make_job: Callable[..., Job],
) -> None:
    job = make_job(train__steps=5, checkpoint__interval=2, checkpoint__keep=2)
    trainer, seen = collect(job)
    assert [r["step"] for r in seen] == [1, 2, 3, 4, 5]
    root = Path(job.spec.checkpoint.dir)
    # keep=2: step_2 was purged; step_5 is the final save
    assert sorted(p.name for p in (root / "job").iterdir()) == ["step_4", "step_5"]
    assert (step_dir(root, "job", 5) / "done").is_file()
    again = Trainer(job)
    assert again.maybe_resume() == 5
    assert again.state.tokens == 5 * job.spec.tokens_per_step
    for name, tensor in trainer.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], tensor), name
    assert again.run()["step"] == 5, "a finished job resumed does no more steps"


def test_corrupt_or_incomplete_newest_checkpoint_falls_back_to_older(
    make_job: Callable[..., Job], caplog: pytest.LogCaptureFixture
) -> None:
    job = make_job(train__steps=4, checkpoint__interval=2, checkpoint__keep=3)
    collect(job)
    root = Path(job.spec.checkpoint.dir)
    for shard in step_dir(root, "job", 4).glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:1000])  # truncated, though `done` exists
    half_written = step_dir(root, "job", 6)
    half_written.mkdir()
    (half_written / "__0_0.distcp").write_bytes(b"partial")  # a crash before `done`

    caplog.set_level(logging.WARNING)
    resumed = Trainer(make_job(train__steps=6, checkpoint__interval=2))
    assert resumed.maybe_resume() == 2
    assert "step_4 is unreadable" in caplog.text
    assert not half_written.exists(), "an incomplete checkpoint is removed at start"


def test_every_complete_checkpoint_unreadable_is_an_error_not_a_fresh_start(
    make_job: Callable[..., Job],
) -> None:
    """Restarting at step 1 over checkpoints that exist would throw the run away silently (and
    the next save would purge them): the trainer stops with a config error naming them."""
    from hlat_trainer.errors import UserError

    job = make_job(train__steps=4, checkpoint__interval=2, checkpoint__keep=3)
    collect(job)
    root = Path(job.spec.checkpoint.dir)
    for step in (2, 4):
        for shard in step_dir(root, "job", step).glob("*.distcp"):
            shard.write_bytes(b"garbage")
    with pytest.raises(UserError, match=r"no complete checkpoint .* could be loaded") as err:
        Trainer(make_job(train__steps=6, checkpoint__interval=2)).maybe_resume()
    assert "step_2" in str(err.value) and "step_4" in str(err.value)
    assert (step_dir(root, "job", 2) / "done").exists(), "nothing was deleted"


def test_prometheus_endpoint_serves_training_metrics(make_job: Callable[..., Job]) -> None:
    job = make_job(train__steps=3)
    metrics = TrainMetrics()
    port = metrics.serve(0, addr="127.0.0.1")
    trainer = Trainer(job, sinks=[metrics.update])
    last = trainer.run()
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {line.split()[0]: float(line.split()[1]) for line in body.splitlines()
              if line.startswith("hlat_train_")}
    assert values["hlat_train_step"] == 3
    assert values["hlat_train_loss"] == pytest.approx(last["loss"])
    assert values["hlat_train_tokens_total"] == 3 * job.spec.tokens_per_step
    # a CPU rank's own compute time (no wait on peers in it) is measured: the straggler score
    assert 0 < last["compute_seconds"] == values["hlat_train_compute_seconds"]
    assert 0 <= last["sync_seconds"] == values["hlat_train_sync_seconds"]  # no peers: ~0
    # and its wait for its own data loader, the straggler score's other part
    waited = last["data_wait_median_seconds"]
    assert 0 < waited == values["hlat_train_data_wait_median_seconds"]
    # and the rest of its step: the host's own work (the update, clipping, moving batches)
    assert 0 < last["host_seconds"] == values["hlat_train_host_seconds"]
    for name in ("grad_norm", "param_norm", "lr", "tokens_per_second", "mfu", "step_seconds",
                 "data_wait_seconds", "checkpoint_blocking_seconds", "compute_seconds",
                 "sync_seconds", "data_wait_median_seconds", "host_seconds"):
        assert f"hlat_train_{name}" in values, name
    # the heartbeat carries the medians the operator scores nodes on, and where the rest goes
    beat = LeaseHeartbeat(None, "default", "w-0", "w-0", 1.0, attempt=0)
    beat(last)
    assert (beat.beat.compute_seconds, beat.beat.data_wait_seconds, beat.beat.host_seconds) == (
        last["compute_seconds"], waited, last["host_seconds"])


def test_a_slow_host_side_update_shows_as_host_overhead_not_as_compute(
        make_job: Callable[..., Job], monkeypatch: pytest.MonkeyPatch) -> None:
    """An optimizer step that takes an hour longer (a host slowed by a noisy neighbour, a
    throttled CPU): the step's host overhead grows by it, its compute time does not. The update
    moves the engine's clock on by the hour rather than sleeping: a loaded CI machine once made
    this tiny model's median compute 81 ms, over a 50 ms sleep, and no load makes it an hour."""
    job = make_job(train__steps=6, checkpoint__interval=100)
    trainer = Trainer(job)
    update = trainer.engine.optimizer.step
    late = [0.0]
    monkeypatch.setattr(engine, "time", SimpleNamespace(
        perf_counter=lambda: time.perf_counter() + late[0]))

    def slow_update(*args: Any, **kwargs: Any) -> Any:
        late[0] += 3600.0
        return update(*args, **kwargs)

    trainer.engine.optimizer.step = slow_update  # type: ignore[method-assign]
    last = trainer.run()
    assert last["host_seconds"] >= 3600.0 > last["compute_seconds"], last


@pytest.mark.parametrize("slow", ["forward", "update"])
def test_on_a_device_the_host_does_not_time_compute_and_sync_are_the_device_s_spans(
        make_job: Callable[..., Job], monkeypatch: pytest.MonkeyPatch, slow: str) -> None:
    """The engine's calls to a device clock (`devicetime.EventClock`, what a CUDA backend
    gives), on CPU: events that complete as they are recorded, at the engine's own clock, and
    a forward or an update that moves that clock on by an hour. A slow forward is compute, a
    slow update (a wait for a peer in its all-reduce) is sync: each span begins and ends where
    the engine says."""
    job = make_job(train__steps=4, checkpoint__interval=100)
    trainer = Trainer(job)
    late = [0.0]
    now = lambda: time.perf_counter() + late[0]  # noqa: E731
    monkeypatch.setattr(engine, "time", SimpleNamespace(perf_counter=now))

    class Instant:
        at: float | None = None

        def record(self) -> None:
            self.at = now()

        def query(self) -> bool:
            return self.at is not None

        def elapsed_time(self, end_event: Instant) -> float:
            assert self.at is not None and end_event.at is not None
            return (end_event.at - self.at) * 1000.0

    trainer.engine.device_clock = EventClock(Instant)
    target = trainer.engine.model if slow == "forward" else trainer.engine.optimizer
    method = "forward" if slow == "forward" else "step"
    real = getattr(target, method)

    def slowed(*args: Any, **kwargs: Any) -> Any:
        late[0] += 3600.0
        return real(*args, **kwargs)

    monkeypatch.setattr(target, method, slowed)
    last = trainer.run()
    compute, sync = last["compute_seconds"], last["sync_seconds"]
    if slow == "forward":
        assert compute >= 3600.0 > sync, last
    else:
        assert sync >= 3600.0 > compute, last


def test_graph_extraction_runs_save_no_checkpoint(
    make_job: Callable[..., Job], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under neuron_parallel_compile's extraction tensors are dummies: a `done` checkpoint of
    them would be what the real job resumes from."""
    monkeypatch.setenv("NEURON_EXTRACT_GRAPHS_ONLY", "1")
    job = make_job(train__steps=2, checkpoint__interval=1)
    collect(job)
    assert not list(Path(job.spec.checkpoint.dir).glob("*/step_*"))


def test_the_spike_monitor_sees_every_step_while_values_are_read_only_when_logged(
    make_job: Callable[..., Job], monkeypatch: pytest.MonkeyPatch
) -> None:
    from hlat_trainer.backends.base import Backend

    reads: list[int] = []
    real = Backend.to_host
    monkeypatch.setattr(Backend, "to_host",
                        lambda self, ts: reads.append(len(ts)) or real(self, ts))
    job = make_job(train__steps=6, train__logInterval=3, checkpoint__interval=6)
    trainer, seen = collect(job)
    assert [r["step"] for r in seen] == [3, 6]
    # per logged step: the pending grad norms, then loss + grad norm + param norm; the save
    # at step 6 comes first and takes that step's norm
    assert [n for n in reads if n] == [3, 3, 3, 3]
    assert len(trainer.state.monitor.recent) == 6


def test_every_second_of_an_attempt_is_charged_to_one_activity(
    make_job: Callable[..., Job], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ledger the heartbeat carries: its activities add up to the attempt's wall time,
    steps an earlier attempt finished (HLAT_STEPS_DONE) are recompute, not productive, and
    asynchronous saves and the last write's wait are charged as such."""
    import time

    from hlat_api import Env

    monkeypatch.setenv(Env.STEPS_DONE, "3")
    started = time.monotonic()
    monkeypatch.setenv(Env.LAUNCHED_MONOTONIC, f"{started - 2.0:.6f}")  # the launcher, 2 s ago
    job = make_job(train__steps=6, checkpoint__interval=2, checkpoint__async=True)
    trainer, seen = collect(job)
    spent = trainer.ledger.snapshot()
    elapsed = time.monotonic() - started + 2.0  # the run's tail after its last charge: not in
    assert elapsed - 0.5 < spent.total() <= elapsed  # the ledger (closing the loader, logging)
    assert spent.startup >= 2.0  # from the launcher's start, not the process's
    assert spent.recompute > 0 and spent.productive > 0
    assert spent.checkpoint > 0 and spent.compile == 0  # eager CPU compiles nothing
    assert [r["recomputed"] for r in seen] == [True, True, True, False, False, False]
    # the loop's step times, as logged, are the steps' activities (saves excluded)
    logged = sum(r["step_seconds"] for r in seen)
    assert spent.productive + spent.recompute + spent.data_wait == pytest.approx(logged, rel=0.1)


def test_a_logged_step_is_charged_up_to_its_line_and_writing_the_line_to_the_next(
    make_job: Callable[..., Job]
) -> None:
    """When a step's line goes out, the ledger (what the heartbeat carries) holds exactly the
    steps logged so far: a worker lost while writing it has lost unreported time, not
    productive time its log never showed. Writing a line (a slow sink here) is the next
    step's time, as in the next line's stepSeconds."""
    import time

    job = make_job(train__steps=4, checkpoint__interval=4)
    seen: list[tuple[float, float]] = []  # (ledger's training seconds, logged step seconds)
    logged = 0.0

    def slow_sink(stats: dict[str, Any]) -> None:
        nonlocal logged
        logged += stats["step_seconds"]
        spent = trainer.ledger.snapshot()
        seen.append((spent.productive + spent.data_wait, logged))
        time.sleep(0.3)

    trainer = Trainer(job, sinks=[slow_sink])
    trainer.run()
    assert len(seen) == 4
    for charged, total in seen:
        assert charged == pytest.approx(total, abs=0.02), seen


def test_a_beat_during_a_save_names_the_step_its_ledger_counts(
    make_job: Callable[..., Job]
) -> None:
    """The step a beat names and the productive time it carries move together: during step
    2's save the beat says step 2 (its time is in the ledger), not the last line's step 1. The
    operator tells the next gang which steps were done from that step: with 1, a worker lost
    in the save had step 2 counted productive twice."""
    job = make_job(train__steps=4, checkpoint__interval=2, train__logInterval=4)
    trainer = Trainer(job)
    trainer.heartbeat = recorder = Recorder()  # type: ignore[assignment]
    trainer.run()
    beats = recorder.beats
    saving = [(b["step"], b["activity"].productive) for b in beats
              if b.get("phase") == "checkpointing"]
    assert [step for step, _ in saving][:2] == [2, 4], beats
    trained = [(b["step"], b["activity"].productive) for b in beats if b.get("phase") == "training"]
    # step 2's time is in it, and nothing after step 2's
    assert saving[0][1] > max(p for step, p in trained if step == 1)
    assert saving[0][1] == pytest.approx(max(p for step, p in trained if step == 2), abs=0.002)


def test_a_failed_asynchronous_write_never_gets_done_nor_purges_the_good_checkpoint(
    make_job: Callable[..., Job], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The write of step_4 fails in the background (its directory is gone when the delayed
    writer starts: a real ENOTDIR from the filesystem); with keep=1 a commit of it would have
    purged step_2, the only good checkpoint."""
    import shutil

    monkeypatch.setenv("HLAT_FAULT_CHECKPOINT_WRITE_DELAY_SECONDS", "1.5")
    job = make_job(train__steps=4, checkpoint__interval=2, checkpoint__keep=1,
                   checkpoint__async=True)
    trainer = Trainer(job)
    trainer.save(2)
    trainer.engine.wait()
    root = Path(job.spec.checkpoint.dir)
    assert (step_dir(root, "job", 2) / "done").exists()
    trainer.save(4)  # returns at once; the write sleeps 1.5 s first
    target = step_dir(root, "job", 4)
    for _ in range(50):  # the writer's planning (on its own thread) may create it again
        shutil.rmtree(target, ignore_errors=True)
        with contextlib.suppress(IsADirectoryError):
            target.write_bytes(b"not a directory")
            break
    assert target.is_file()
    trainer.engine.wait()
    assert not (step_dir(root, "job", 4) / "done").exists()
    assert (step_dir(root, "job", 2) / "done").exists(), "the good checkpoint was purged"
    assert trainer.engine.committed == 2


def test_a_fenced_trainer_marks_no_checkpoint_complete(make_job: Callable[..., Job]) -> None:
    """Once this trainer's attempt is over (its Lease refuses renewals: `fenced_now` is the
    heartbeat's), a save still writes its shards but never gets `done`, sync or async."""
    for async_ in (False, True):
        job = make_job(train__steps=4, checkpoint__interval=2, checkpoint__async=async_)
        trainer = Trainer(job)
        fenced = [False]
        trainer.engine.fence(lambda box=fenced: box[0])  # type: ignore[misc]
        trainer.save(2)
        trainer.engine.wait()
        root = Path(job.spec.checkpoint.dir)
        assert (step_dir(root, "job", 2) / "done").exists()
        fenced[0] = True
        trainer.save(4)
        trainer.engine.wait()
        assert step_dir(root, "job", 4).exists()
        assert not (step_dir(root, "job", 4) / "done").exists(), async_
        assert trainer.engine.committed == 2
        shutil.rmtree(root)


class _LeaseAPI:
    """The trainer's Lease writes, answered as `answer` says: "away" (connection reset: an
    API server out of reach), "refuse" (403: the attempt is over) or "accept"."""

    def __init__(self) -> None:
        self.answer = "away"

    def patch_namespaced_lease(self, *args: Any, **kwargs: Any) -> None:
        if self.answer == "away":
            raise ConnectionResetError()
        if self.answer == "refuse":
            raise ApiException(status=403, reason="Forbidden")


def _cut_off_trainer(job: Job) -> tuple[Trainer, _LeaseAPI]:
    """A trainer whose Lease renewals have not been accepted for longer than its duration."""
    api = _LeaseAPI()
    trainer = Trainer(job)
    trainer.heartbeat = LeaseHeartbeat(api, "ns", "job-0", "job-0", period=0.1, attempt=0)
    trainer.engine.fence(trainer.heartbeat.fenced_now, trainer.heartbeat.fenced_lately)
    trainer.heartbeat._accepted_at -= 10
    trainer.heartbeat.start()
    return trainer, api


@pytest.mark.parametrize("async_", [False, True], ids=["sync", "async"])
def test_a_run_ending_while_the_api_server_is_away_commits_its_last_checkpoint_once_back(
        make_job: Callable[..., Job], async_: bool, caplog: pytest.LogCaptureFixture) -> None:
    """No renewal accepted for longer than the Lease's duration as the run ends: its last
    checkpoint is written but held back (another attempt may hold the rank); it has no later
    one to commit instead, so the trainer waits for the API server and commits it once a
    renewal is accepted, before it exits."""
    job = make_job(train__steps=4, checkpoint__interval=100, checkpoint__async=async_)
    trainer, api = _cut_off_trainer(job)
    root = Path(job.spec.checkpoint.dir)

    def back_once_held() -> None:
        deadline = time.monotonic() + 120
        while trainer.engine.withheld_checkpoint() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # away a while longer: the trainer waits meanwhile
        api.answer = "accept"

    helper = threading.Thread(target=back_once_held, daemon=True)
    helper.start()
    with caplog.at_level(logging.INFO):
        trainer.run()
    helper.join()
    assert "the run's last, is written but not committed" in caplog.text
    assert (step_dir(root, "job", 4) / "done").exists()
    assert trainer.engine.committed == 4 and trainer.engine.withheld_checkpoint() is None


def test_a_run_ending_cut_off_gives_up_in_its_bound_or_stops_when_refused(
        make_job: Callable[..., Job], monkeypatch: pytest.MonkeyPatch) -> None:
    """Never back within `FINAL_COMMIT_WAIT_SECONDS`: a failure (the operator restarts from the
    newest complete checkpoint); refused for good: stopped as fenced. Neither commits."""
    monkeypatch.setattr(train, "FINAL_COMMIT_WAIT_SECONDS", 1)
    monkeypatch.setattr(heartbeat, "REFUSAL_CONFIRM_SECONDS", 0.3)
    for answer in ("away", "refuse"):
        job = make_job(name=f"job-{answer}", train__steps=4, checkpoint__interval=100)
        trainer, api = _cut_off_trainer(job)
        api.answer = answer
        expected = RuntimeError if answer == "away" else SystemExit
        with pytest.raises(expected) as stopped:
            trainer.run()
        if answer == "refuse":
            assert stopped.value.code == ExitCode.FENCED  # type: ignore[union-attr]
        else:
            assert "no Lease renewal accepted in 1s" in str(stopped.value)
        done = step_dir(Path(job.spec.checkpoint.dir), f"job-{answer}", 4) / "done"
        assert not done.exists()


def test_the_cpu_peak_flops_are_measured_once_per_pod_and_device_type(tmp_path: Path) -> None:
    """hlat-launch gives every attempt of a pod the same HLAT_PEAK_FLOPS_FILE: the next
    attempt reuses the measured peak (the probe is a fraction of a second of each restart);
    another dtype is measured on its own; an unreadable file is measured over."""
    from hlat_trainer.train import known_peak_flops

    path = tmp_path / "peak-flops.json"
    cpu = torch.device("cpu")
    first = known_peak_flops(cpu, torch.float32, str(path))
    assert first > 0 and json.loads(path.read_text()) == {"cpu/float32": first}
    assert known_peak_flops(cpu, torch.float32, str(path)) == first  # read, not re-measured
    bf16 = known_peak_flops(cpu, torch.bfloat16, str(path))
    assert json.loads(path.read_text()) == {"cpu/float32": first, "cpu/bfloat16": bf16}
    path.write_text("{not json")
    again = known_peak_flops(cpu, torch.float32, str(path))
    assert again > 0 and json.loads(path.read_text()) == {"cpu/float32": again}
    assert known_peak_flops(cpu, torch.float32, None) > 0 and not (tmp_path / "None").exists()


def test_the_update_waits_for_an_asynchronous_save_s_copy_of_the_state(
    make_job: Callable[..., Job],
) -> None:
    """A save returns while its copy of the state is still being taken on the stager's
    thread (slowed down here to 0.5 s): the next step's update must wait for it, or the
    checkpoint of step N holds step N+1's weights. The wait is charged as checkpoint time."""
    import time as clock

    from torch.distributed.checkpoint import load as dcp_load

    job = make_job(train__steps=3, checkpoint__interval=1, checkpoint__keep=3,
                   checkpoint__async=True, train__logInterval=1)
    seen: dict[int, dict[str, torch.Tensor]] = {}
    trainer = Trainer(job)
    stager = trainer.engine.checkpointer.stager  # type: ignore[attr-defined]
    copy = stager._stage

    def slow_copy(state: Any, **kw: Any) -> Any:
        clock.sleep(0.5)
        return copy(state, **kw)

    stager._stage = slow_copy
    checkpointer = trainer.engine.checkpointer  # type: ignore[attr-defined]
    waited: list[float] = []
    wait_staged = checkpointer.wait_staged
    checkpointer.wait_staged = lambda: waited.append(wait_staged()) or waited[-1]
    trainer.sinks.append(lambda s: seen.__setitem__(int(s["step"]), {
        k: v.detach().clone() for k, v in trainer.model.state_dict().items()}))
    trainer.run()
    root = Path(job.spec.checkpoint.dir)
    for step in (1, 2):
        loaded = {k: torch.zeros_like(v) for k, v in seen[step].items()}
        dcp_load({"model": loaded}, checkpoint_id=step_dir(root, "job", step))
        assert all(torch.equal(loaded[k], seen[step][k]) for k in loaded), step
    # the waits, as checkpoint time (how long they are depends on how much of the copy the
    # step's forward and backward overlapped: the less, the busier the machine)
    assert sum(waited) > 0 and trainer.ledger.seconds["checkpoint"] >= sum(waited)


def test_snapshots_and_a_restore_from_memory_are_charged_as_their_own_causes(
    make_job: Callable[..., Job], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """checkpoint.memoryInterval: the time snapshots hold the loop is `snapshot`, not the
    durable `checkpoint`; an attempt that resumes from memory charges its load to
    `memory_restore` and nothing to `restore` (the durable path's cause). The goodput table
    and the operator's restart cost read them apart."""
    from hlat_api import Env

    monkeypatch.setenv(Env.SNAPSHOT_DIR, str(tmp_path / "shm"))
    job = make_job(train__steps=4, checkpoint__interval=100, checkpoint__memoryInterval=1)
    first, _ = collect(job)
    spent = first.ledger.snapshot()
    assert spent.snapshot > 0 and first.resumed_from == "checkpoint"
    assert spent.memory_restore == 0
    again, seen = collect(make_job(train__steps=6, checkpoint__interval=100,
                                   checkpoint__memoryInterval=1))
    spent = again.ledger.snapshot()
    assert again.resumed_from == "snapshot" and seen[0]["step"] == 5
    assert spent.memory_restore > 0 and spent.restore == 0, spent


def test_a_resume_past_the_steps_the_operator_saw_reports_their_time_once(
    make_job: Callable[..., Job], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker lost after its last renewal (the operator saw step 2) but after its snapshot
    of step 4: the next attempt resumes at 5, never trains steps 3 and 4 again, and its first
    beat carries what they took in the attempt that trained them (the time its ledger counted
    productive from its beat of step 2 to its snapshot of step 4), so that goodput counts
    them."""
    from hlat_api import Env

    monkeypatch.setenv(Env.SNAPSHOT_DIR, str(tmp_path / "shm"))
    spec = {"checkpoint__interval": 100, "checkpoint__memoryInterval": 1}
    first = Trainer(make_job(train__steps=4, **spec))
    first.heartbeat = lost = Recorder()  # type: ignore[assignment]
    taken: dict[int, float] = {}  # the ledger's productive time as each snapshot is taken
    snapshot = first.snapshot

    def snapshot_seen(step: int) -> float:
        taken[step] = first.ledger.seconds["productive"]
        return snapshot(step)

    first.snapshot = snapshot_seen  # type: ignore[method-assign]
    first.run()
    productive = {b["step"]: b["activity"].productive for b in lost.beats
                  if b.get("phase") == "training"}
    monkeypatch.setenv(Env.STEPS_DONE, "2")
    again = Trainer(make_job(train__steps=6, **spec))
    again.heartbeat = next_ = Recorder()  # type: ignore[assignment]
    again.run()
    assert again.resumed_from == "snapshot" and again.first_step == 5
    start = next(b for b in next_.beats if "resumed_step" in b)
    assert start["resumed_step"] == 4
    # steps 3 and 4 as charged when step 4's snapshot was taken (its log line is written
    # after: that part of step 4 is in no snapshot, and stays in the lost attempt's detection)
    carried = taken[4] - productive[2]
    assert 0 < carried <= productive[4] - productive[2]
    assert start["carried_seconds"] == pytest.approx(carried, abs=0.002), (start, productive)
    # what the attempt itself trained is productive as before, and nothing twice
    assert again.state.carried_after(6) == 0
    assert again.state.carried_after(4) == pytest.approx(
        sum(again.state.seconds[k] for k in (5, 6)))


def test_the_step_times_a_state_keeps_are_bounded_and_survive_a_checkpoint() -> None:
    state = train.TrainState(step=train.RECENT_STEPS + 10)
    for step in range(1, train.RECENT_STEPS + 11):
        state.trained(step, 0.5)
        state.trained(step, 0.25)  # a step is charged in parts
    assert len(state.seconds) == train.RECENT_STEPS and min(state.seconds) == 11
    # through the loop state's own serialization (torch.load weights_only, as a resume reads
    # it): a rank's state with step times, and one without (every rank but 0)
    back = train.TrainState()
    back.load_state_dict(unpack(pack(state.state_dict())))
    assert back.carried_after(train.RECENT_STEPS + 8) == pytest.approx(1.5)
    assert back.seconds == state.seconds
    other = train.TrainState(step=5)
    back.load_state_dict(unpack(pack(other.state_dict())))
    assert back.seconds == {} and back.carried_after(0) == 0
    old = state.state_dict()
    del old["seconds"]  # a checkpoint written before step times were kept
    back.load_state_dict(unpack(pack(old)))
    assert back.carried_after(0) == 0


@pytest.mark.parametrize("share, every_step", [(0.01, False), (100.0, True)])
def test_memory_interval_auto_keeps_snapshots_under_their_share_of_the_training_time(
    make_job: Callable[..., Job], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    share: float, every_step: bool,
) -> None:
    """checkpoint.memoryInterval auto: a probe snapshot after the attempt's third step, then
    the smallest interval whose snapshots hold the loop under the share (1%) of the training
    time. Snapshots slowed to 50 ms each against a tiny model's steps: one every few hundred
    steps (only the probe in 12); allowed 100x the training time: every step."""
    from hlat_api import Env
    from hlat_trainer import snapshot, train

    monkeypatch.setenv(Env.SNAPSHOT_DIR, str(tmp_path / "shm"))
    monkeypatch.setattr(train, "SNAPSHOT_AUTO_SHARE", share)
    taken: list[int] = []
    save = snapshot.Snapshots.save

    def slow(self: snapshot.Snapshots, step: int, state: dict[str, Any]) -> float:
        time.sleep(0.05)
        taken.append(step)
        return save(self, step, state)

    monkeypatch.setattr(snapshot.Snapshots, "save", slow)
    trainer, _ = collect(make_job(train__steps=12, checkpoint__interval=100,
                                  checkpoint__memoryInterval="auto"))
    assert trainer.snapshot_every is not None
    if every_step:
        assert trainer.snapshot_every == 1 and taken == list(range(3, 13)), taken
    else:
        assert trainer.snapshot_every > 12 and taken == [3], (trainer.snapshot_every, taken)
    spent = trainer.ledger.snapshot()
    assert spent.snapshot >= 0.05 * len(taken)
