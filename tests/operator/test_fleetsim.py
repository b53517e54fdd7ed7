"""The fleet simulator (hlat_operator.fleetsim): uptime and goodput under faults, the checkpoint
interval that maximises goodput, and its CLI. Small scenarios, a few hundred runs: fast."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hlat_operator import fleetsim as fs
from hlat_operator import fleetsim_cli as cli

DAY = fs.DAY
QUICK = {k: fs.FaultCost(detection_s=10.0, recovery_s=60.0) for k in fs.KINDS}


def faulty(**changes: Any) -> fs.Scenario:
    """64 nodes for a week with the default costs and a fault every ~6 h of the gang."""
    return replace(fs.Scenario(duration_s=7 * DAY, node_mtbf_s=64 * 6 * 3600.0), **changes)


@pytest.mark.parametrize(("saves", "blocked_per_save"), [
    (fs.sync_saves(3600.0, 100.0), 100.0),
    (fs.async_saves(3600.0, 10.0, 50.0), 10.0),
])
def test_without_faults_uptime_is_one_and_goodput_loses_only_the_saves(
        saves: fs.Checkpointing, blocked_per_save: float) -> None:
    tl = fs.simulate(fs.Scenario(duration_s=DAY), runs=3, seed=0)
    fig = fs.evaluate(tl, saves)
    # a day holds 23 cycles of 3600 s training + one save, then 1300-3370 s of training
    assert fig.uptime.tolist() == [1.0] * 3
    assert fig.goodput == pytest.approx(1 - 23 * blocked_per_save / DAY)
    assert fig.faults.sum() == 0 and fig.lost_work_s.sum() == 0


@pytest.mark.parametrize(("up", "saved"), [(3640.0, 0.0), (3660.0, 3600.0)])
def test_a_fault_before_the_async_write_completes_loses_the_whole_interval(
        up: float, saved: float) -> None:
    # the save starts after 3600 s of training, blocks 10 s and is complete at 3650 s
    trained, blocked, covered = fs.attempt_work(np.array([up]), fs.async_saves(3600.0, 10.0, 50.0))
    assert (trained[0], blocked[0], covered[0]) == (up - 10.0, 10.0, saved)
    _, _, covered_sync = fs.attempt_work(np.array([3650.0]), fs.sync_saves(3600.0, 50.0))
    assert covered_sync[0] == 3600.0


def test_recovery_beats_restarting_by_hand_on_the_same_faults() -> None:
    auto = fs.simulate(faulty(), runs=30, seed=7)
    by_hand = fs.simulate(faulty(auto_recovery=False), runs=30, seed=7)
    # the same arrivals in the gang's running clock: by hand meets a prefix of them (it is down
    # longer, so fewer fit in the week)
    n = len(by_hand.faulted_up)
    assert 0 < n < len(auto.faulted_up)
    for run in range(30):
        mine = by_hand.faulted_up[by_hand.faulted_run == run]
        assert np.array_equal(mine, auto.faulted_up[auto.faulted_run == run][:len(mine)])
    saves = fs.sync_saves(2000.0)
    assert np.all(fs.evaluate(auto, saves).uptime > fs.evaluate(by_hand, saves).uptime)


def test_goodput_is_below_uptime_whenever_a_fault_happens() -> None:
    tl = fs.simulate(faulty(node_mtbf_s=64 * 3 * DAY), runs=40, seed=1)
    fig = fs.evaluate(tl, fs.async_saves(1800.0))
    hit = fig.faults.sum(axis=1) > 0
    assert hit.any() and not hit.all()  # both cases occur at a fault every ~3 days
    assert np.all(fig.goodput[hit] < fig.uptime[hit])
    assert np.all(fig.lost_work_s[hit] > 0) and np.all(fig.uptime[hit] < 1)


def test_people_on_call_at_night_restart_sooner_than_a_day_shift() -> None:
    day_shift = fs.simulate(faulty(auto_recovery=False), runs=30, seed=3)
    round_clock = fs.simulate(
        faulty(auto_recovery=False, people=fs.People(work_start_h=0, work_end_h=24)),
        runs=30, seed=3)
    saves = fs.sync_saves(2000.0)
    assert (fs.evaluate(round_clock, saves).uptime.mean()
            > fs.evaluate(day_shift, saves).uptime.mean() + 0.05)
    assert fs.People().wait_s(20.0) == 13 * 3600 and fs.People().wait_s(10.0) == 0


def test_sweep_optimum_agrees_with_young_daly_when_their_assumptions_hold() -> None:
    # exponential faults, save cost 10 s << MTBF 1e5 s (Young: 1414 s, Daly: 1407 s)
    scenario = fs.Scenario(nodes=1, duration_s=28 * DAY, node_mtbf_s=1e5, costs=QUICK)
    tl = fs.simulate(scenario, runs=300, seed=0)
    daly = fs.daly_interval(10.0, 1e5)
    assert daly == pytest.approx(fs.young_interval(10.0, 1e5), rel=0.01)
    grid = np.geomspace(daly / 4, daly * 4, 41)
    curve = fs.sweep(tl, grid, lambda t: fs.sync_saves(t, 10.0))
    assert fs.best_interval(grid, curve) == pytest.approx(daly, rel=0.10)
    assert curve[20] > curve[0] + 0.002 and curve[20] > curve[-1] + 0.002


def test_fitted_rate_reproduces_the_target_uptime_with_recovery() -> None:
    base = fs.Scenario(duration_s=14 * DAY)
    scenario = fs.Scenario(duration_s=14 * DAY, node_mtbf_s=fs.fitted_node_mtbf_s(base, 0.95))
    fig = fs.evaluate(fs.simulate(scenario, runs=100, seed=0), fs.sync_saves(2000.0))
    assert fig.uptime.mean() == pytest.approx(0.95, abs=0.003)
    # the CLI fits the paper's 64 nodes: half the gang keeps the per-node rate, fails half as often
    half = fs.node_mtbf_for("hlat", fs.Scenario(nodes=32), fs.PAPER_UPTIME_WITH)
    assert half == fs.node_mtbf_for("hlat", fs.Scenario(nodes=64), fs.PAPER_UPTIME_WITH)
    # Llama 3's Table 5, as transcribed, adds up to its 419 unexpected interruptions
    assert sum(n for n, _ in fs.LLAMA3_ROOT_CAUSES.values()) == fs.LLAMA3_UNEXPECTED
    assert math.fsum(fs.LLAMA3_SHARES.values()) == pytest.approx(1.0)


def test_same_seed_same_report_other_seed_other_report() -> None:
    scenario = faulty()
    one = cli.fleet_report(scenario, 2000.0, runs=8, seed=5, sweep_points=7)
    assert one == cli.fleet_report(scenario, 2000.0, runs=8, seed=5, sweep_points=7)
    other = cli.fleet_report(scenario, 2000.0, runs=8, seed=6, sweep_points=7)
    assert one["scenarios"][0]["goodput"] != other["scenarios"][0]["goodput"]


def test_cli_json_has_the_four_scenarios_and_the_optima(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    assert cli.main(["--json", "--runs", "5", "--days", "7", "--sweep-points", "9"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"inputs", "scenarios", "optimum", "sweep", "runs", "seed"} <= set(report)
    assert [s["name"] for s in report["scenarios"]] == [
        "recovery, sync", "recovery, async", "by hand, sync", "by hand, async"]
    for s in report["scenarios"]:
        assert {"uptime", "goodput", "faults", "lost_work_s", "down_s"} <= set(s)
        assert set(s["faults"]) == set(fs.KINDS)
        assert 0 < s["goodput"]["mean"] < s["uptime"]["mean"] <= 1
    for mode in ("sync", "async"):
        assert {"young_s", "daly_s", "sweep_s", "sweep_over_daly"} <= set(report["optimum"][mode])
    assert report["inputs"]["rate"] == "hlat"


def test_cli_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "goodput.png"
    assert cli.main(["--runs", "3", "--days", "3", "--sweep-points", "9", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "recovery, async" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "named"), [
    (["--nodes", "-1"], "--nodes"),
    (["--days", "0"], "--days"),
    (["--runs", "0"], "--runs"),
    (["--interval", "-5"], "--interval"),
    (["--work-hours", "18", "9"], "--work-hours"),
    (["--target-uptime", "1.5"], "--target-uptime"),
    (["--recovery", "meteor=5"], "--recovery"),
])
def test_cli_bad_input_names_the_parameter(argv: list[str], named: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize(("build", "named"), [
    (lambda: fs.Scenario(nodes=0), "nodes"),
    (lambda: fs.Scenario(duration_s=0), "duration_s"),
    (lambda: fs.Checkpointing(interval_s=0, block_s=1, complete_s=1), "interval_s"),
])
def test_api_bad_input_raises_value_error_naming_the_field(build: Callable[[], object],
                                                          named: str) -> None:
    with pytest.raises(ValueError, match=named):
        build()


# --- fail-slow nodes ------------------------------------------------------------------------

def test_the_falcon_fitted_rate_reproduces_falcon_s_slowdown_when_left_alone() -> None:
    """A 64-node job for four weeks at the fitted rate, left alone, is slowed by Falcon's
    at-scale mean (1.3459x); the probe jobs' rate is of the same order (a check of the fit)."""
    slow = fs.FailSlow(fs.falcon_fitted_mtbs_s(64))
    lost = fs.fail_slow_lost(64, 28 * DAY, slow, runs=300, seed=0)
    assert 1 / (1 - lost.mean()) == pytest.approx(fs.FALCON_SCALE_SLOWDOWN, rel=0.02)
    assert 0.2 < fs.falcon_probe_mtbs_s() / slow.node_mtbs_s < 5


def test_moving_off_a_slow_node_at_the_next_checkpoint_recovers_most_of_the_loss() -> None:
    """Replace at the next checkpoint: less lost than left alone on the same fail-slows, more
    than a move that cost nothing; a move dearer than what a fail-slow costs is not made."""
    slow = fs.FailSlow(fs.falcon_fitted_mtbs_s(64))
    alone = fs.fail_slow_lost(64, 28 * DAY, slow, runs=200, seed=1)
    cheap = fs.Replace(detection_s=35.0, checkpoint_interval_s=600.0, move_s=60.0)
    moved = fs.fail_slow_lost(64, 28 * DAY, slow, runs=200, seed=1, replace_=cheap)
    free = fs.fail_slow_lost(64, 28 * DAY, slow, runs=200, seed=1,
                             replace_=replace(cheap, move_s=0.0, checkpoint_interval_s=0.0))
    assert free.mean() < moved.mean() < 0.5 * alone.mean()
    dear = replace(cheap, move_s=2 * slow.lost_per_event_s)
    assert not dear.worth_it(slow)
    assert np.array_equal(fs.fail_slow_lost(64, 28 * DAY, slow, 50, 1, dear), alone[:50])


def test_fail_slow_bad_input_names_the_field() -> None:
    with pytest.raises(ValueError, match="factor"):
        fs.FailSlow(3600.0, factor=1.0)


# --- node losses without replacement capacity (elastic) ----------------------------------------

def _loss(replacement_h: float, **changes: Any) -> fs.NodeLoss:
    """A node lost every ~2 days of a 64-node gang, 10 s to detect, 300 s to restart."""
    return fs.NodeLoss(**{"node_mtbf_s": 64 * 2 * DAY, "replacement_s": replacement_h * 3600,
                          "detection_s": 10.0, "restart_s": 300.0,
                          "checkpoint_interval_s": 1800.0, **changes})


def test_a_rigid_job_loses_the_whole_gang_until_the_replacement_comes() -> None:
    """Without elasticity each loss costs the gang the replacement time, the restart and half a
    checkpoint interval of recomputation: 14 losses in 28 days at 4 h each, about 8.8%."""
    capacity = fs.node_loss_capacity(64, 28 * DAY, _loss(4), runs=400, seed=0)
    per_loss = 4 * 3600 + 300 + 900
    assert 1 - capacity.mean() == pytest.approx(14 * per_loss / (28 * DAY), rel=0.05)


@pytest.mark.parametrize("replacement_h", [1, 4, 24])
def test_shrinking_keeps_capacity_a_rigid_job_loses_and_more_so_the_longer_the_wait(
        replacement_h: float) -> None:
    rigid = fs.node_loss_capacity(64, 28 * DAY, _loss(replacement_h), runs=200, seed=1)
    to_63 = fs.node_loss_capacity(64, 28 * DAY, _loss(replacement_h), runs=200, seed=1,
                                  elastic=fs.Elastic(63, wait_s=60))
    to_32 = fs.node_loss_capacity(64, 28 * DAY, _loss(replacement_h), runs=200, seed=1,
                                  elastic=fs.Elastic(32, wait_s=60))
    assert rigid.mean() < to_32.mean() < to_63.mean() <= 1
    # shrunk to 63 of 64, a loss costs about two restarts and the recomputation whatever the
    # wait (14 losses x 1,500 s of 28 days: 0.9%, plus 1/64 of the time short); a rigid job
    # loses 2.8%, 9.1% and 51% at 1, 4 and 24 h
    assert 1 - to_63.mean() < 0.02
    # 63 nodes at 4/5 of the speed (the paper's 7B: 1,024 micro-batches on 252 ranks, the
    # busiest training 5 instead of 4) keep more than 32 nodes at 1/2, less than 63 at 63/64
    uneven = fs.node_loss_capacity(64, 28 * DAY, _loss(replacement_h), runs=200, seed=1,
                                   elastic=fs.Elastic(63, wait_s=60, speed=0.8))
    assert to_32.mean() < uneven.mean() < to_63.mean()


def test_goodput_counts_the_time_at_the_smaller_size_and_a_checkpoint_asked_for_grows_back_sooner(
) -> None:
    """The job's goodput (time training, at any size) beside its capacity (node-seconds): equal
    for a rigid job, which trains on all its nodes or none; above it for an elastic one, whose
    time short of nodes is productive but not at full capacity. Growing back at a checkpoint
    asked for (a heartbeat period and a write) leaves it short for less than waiting for the
    next periodic one (half a 1,800 s interval at half speed), so more capacity, the same
    goodput (the time down is the same)."""
    loss = _loss(24)
    rigid = fs.node_loss_runs(64, 28 * DAY, loss, 200, 1)
    assert np.allclose(rigid.goodput, rigid.capacity)
    periodic = fs.node_loss_runs(64, 28 * DAY, loss, 200, 1, fs.Elastic(32, 60))
    asked = fs.node_loss_runs(64, 28 * DAY, loss, 200, 1, fs.Elastic(32, 60, asked_write_s=150))
    assert (periodic.goodput > periodic.capacity).all()
    assert rigid.goodput.mean() < periodic.goodput.mean()
    assert np.allclose(asked.goodput, periodic.goodput)
    # per loss about (900 x 2 - 155) x 1/2 node-seconds a node saved: 14 losses of 28 days
    saved = asked.capacity.mean() - periodic.capacity.mean()
    assert saved == pytest.approx(14 * (1800 - 155) / 2 / (28 * DAY), rel=0.2)


@pytest.mark.parametrize("elastic", [None, fs.Elastic(63, 60)], ids=["rigid", "elastic"])
def test_with_snapshots_on_a_peer_a_node_loss_recomputes_since_the_last_snapshot(
        elastic: fs.Elastic | None) -> None:
    """A loss loses the work since the last snapshot (every 60 s, copied to a peer), not half
    the 1,800 s checkpoint interval: per loss 870 s of the gang's time saved on average (14
    losses of 28 days), on the same losses; a snapshot interval above the checkpoint's changes
    nothing (the durable checkpoint is then the newer state)."""
    loss = _loss(4)
    durable = fs.node_loss_runs(64, 28 * DAY, loss, 400, 5, elastic)
    snapped = fs.node_loss_runs(64, 28 * DAY, replace(loss, snapshot_interval_s=60.0), 400, 5,
                                elastic)
    saved = snapped.goodput.mean() - durable.goodput.mean()
    assert saved == pytest.approx(14 * (900 - 30) / (28 * DAY), rel=0.1)
    rare = fs.node_loss_runs(64, 28 * DAY, replace(loss, snapshot_interval_s=3600.0), 400, 5,
                             elastic)
    assert rare.goodput.tolist() == durable.goodput.tolist()


def test_a_size_s_speed_defaults_to_its_share_of_the_nodes() -> None:
    loss = _loss(4)
    assert fs.node_loss_capacity(64, 28 * DAY, loss, 50, 3, fs.Elastic(32, 60)).tolist() == \
        fs.node_loss_capacity(64, 28 * DAY, loss, 50, 3, fs.Elastic(32, 60, 0.5)).tolist()


def test_a_replacement_within_the_wait_is_a_rigid_restart() -> None:
    """The elastic job waits waitSeconds for a spare or a replacement first: one that comes in
    time costs what it costs a rigid job, on the same losses."""
    loss = _loss(0.01)  # 36 s
    rigid = fs.node_loss_capacity(64, 28 * DAY, loss, runs=50, seed=2)
    patient = fs.node_loss_capacity(64, 28 * DAY, loss, runs=50, seed=2,
                                    elastic=fs.Elastic(32, wait_s=120))
    assert patient.tolist() == rigid.tolist()


@pytest.mark.parametrize(("build", "field"), [
    (lambda: fs.NodeLoss(node_mtbf_s=0, replacement_s=1), "node_mtbf_s"),
    (lambda: fs.NodeLoss(node_mtbf_s=1, replacement_s=-1), "replacement_s"),
    (lambda: fs.NodeLoss(node_mtbf_s=1, replacement_s=1, snapshot_interval_s=0),
     "snapshot_interval_s"),
    (lambda: fs.Elastic(0), "size"),
    (lambda: fs.Elastic(4, speed=0), "speed"),
    (lambda: fs.node_loss_capacity(8, DAY, _loss(1), 1, 0, fs.Elastic(8)), "size"),
])
def test_node_loss_bad_input_names_the_field(build: Callable[[], object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        build()


# --- recovery paths: in-memory snapshots and peer replicas (issue 34) --------------------------

def _only(kind: str, **changes: Any) -> fs.Scenario:
    """64 nodes for a week, every fault of one kind, one every ~4 h of the gang."""
    shares = {k: float(k == kind) for k in fs.KINDS}
    return replace(fs.Scenario(duration_s=7 * DAY, node_mtbf_s=64 * 4 * 3600.0, shares=shares),
                   **changes)


def _path_figures(scenario: fs.Scenario, path: fs.RecoveryPath, runs: int = 40,
                  seed: int = 0) -> fs.PathFigures:
    tl = fs.simulate(replace(scenario, costs=path.costs(fs.ClusterTimes())), runs, seed)
    return fs.evaluate_path(tl, fs.async_saves(2000.0, 10.0, 100.0), path)


def test_a_restart_from_memory_loses_at_most_one_snapshot_interval_per_fault() -> None:
    snap = fs.Snapshots(interval_s=200.0, block_s=1.0)
    memory = _path_figures(_only("crash"), fs.RecoveryPath("snapshots", snap))
    durable = _path_figures(_only("crash"), fs.RecoveryPath("today"))
    faults = memory.faults.sum(axis=1)
    assert faults.min() > 20
    assert np.all(memory.lost_work_s <= faults * snap.interval_s)
    # about half an interval a fault (uniform), not half a durable interval (1,000 s)
    assert memory.lost_work_s.sum() / faults.sum() == pytest.approx(100.0, rel=0.1)
    assert durable.lost_work_s.sum() / faults.sum() > 800.0
    assert memory.restores[:, 0].tolist() == faults.tolist()  # all from memory
    assert memory.restores[:, 1:].sum() == 0
    assert memory.goodput.mean() > durable.goodput.mean() + 0.02


def test_with_a_peer_replica_a_node_loss_reads_no_durable_checkpoint_and_loses_less() -> None:
    snap = fs.Snapshots(interval_s=200.0, block_s=1.0)
    built = _path_figures(_only("node_lost"), fs.RecoveryPath("snapshots", snap))
    target = _path_figures(_only("node_lost"),
                           fs.RecoveryPath("target", replace(snap, peer=True), 5.0))
    faults = target.faults.sum(axis=1)
    assert built.restores[:, 2].tolist() == built.faults.sum(axis=1).tolist()  # storage
    assert target.restores[:, 2].sum() == 0 and target.restores[:, 1].tolist() == faults.tolist()
    assert target.lost_work_s.mean() < 0.3 * built.lost_work_s.mean()
    assert target.goodput.mean() > built.goodput.mean()
    # and its restart reads nothing from storage: the peer's load instead of the checkpoint's
    times = fs.ClusterTimes()
    costs = fs.RecoveryPath("target", replace(snap, peer=True), 5.0).costs(times)
    today = fs.RecoveryPath("today").costs(times)
    assert costs["node_lost"].detection_s == 5.0
    assert today["node_lost"].recovery_s - costs["node_lost"].recovery_s == pytest.approx(
        times.checkpoint_load_s - snap.peer_load_s)


def test_a_node_loss_after_a_restore_from_memory_goes_back_to_the_last_durable_save() -> None:
    """By hand: durable saves at multiples of 1,000 s of progress (sync, free), snapshots every
    100 s (free). Both runs: a crash at 1,550 s resumes from the snapshot at 1,500 (50 s lost).
    Run 0: a node lost 300 s later (1,800; no durable save since 1,000) resumes from 1,000 (800
    s lost), then 500 s more: 1,500 s of progress. Run 1: a node lost 600 s later (2,100; the
    durable save at 2,000 made 500 s after the restore) loses 100 s; 2,500 s of progress."""
    tl = fs.Timelines(duration_s=2700.0, faulted_up=np.array([1550.0, 300.0, 1550.0, 600.0]),
                      faulted_run=np.array([0, 0, 1, 1]), faulted_kind=np.array([0, 2, 0, 2]),
                      final_up=np.array([500.0, 500.0]), down=np.array([50.0, 50.0]),
                      faults=np.array([[1, 0, 1], [1, 0, 1]]))
    path = fs.RecoveryPath("snapshots", fs.Snapshots(100.0, block_s=0.0))
    fig = fs.evaluate_path(tl, fs.sync_saves(1000.0, 0.0), path)
    assert fig.lost_work_s.tolist() == pytest.approx([850.0, 150.0])
    assert fig.goodput.tolist() == pytest.approx([1500.0 / 2400.0, 2500.0 / 2700.0])
    assert fig.restores.tolist() == [[1, 0, 1], [1, 0, 1]]


def test_without_snapshots_the_path_model_agrees_with_the_durable_one() -> None:
    tl = fs.simulate(faulty(), runs=30, seed=4)
    for saves in (fs.sync_saves(1500.0), fs.async_saves(1500.0)):
        old, new = fs.evaluate(tl, saves), fs.evaluate_path(tl, saves, fs.RecoveryPath("today"))
        assert new.goodput == pytest.approx(old.goodput, abs=1e-12)
        assert new.lost_work_s == pytest.approx(old.lost_work_s)
        assert new.snapshot_blocking_s.sum() == 0


def test_snapshots_cost_their_blocking_when_nothing_fails() -> None:
    tl = fs.simulate(fs.Scenario(duration_s=DAY), runs=2, seed=0)
    path = fs.RecoveryPath("snapshots", fs.Snapshots(interval_s=100.0, block_s=5.0))
    fig = fs.evaluate_path(tl, fs.sync_saves(DAY * 2, 1.0), path)
    assert fig.goodput == pytest.approx(1 / 1.05)
    assert fig.snapshot_blocking_s == pytest.approx(DAY * (1 - 1 / 1.05))


def test_paths_same_seed_same_figures() -> None:
    path = fs.RecoveryPath("target", fs.Snapshots(300.0, peer=True), 5.0)
    one, two = _path_figures(faulty(), path, 10, 3), _path_figures(faulty(), path, 10, 3)
    assert one.goodput.tolist() == two.goodput.tolist()
    assert one.restores.tolist() == two.restores.tolist()
    assert _path_figures(faulty(), path, 10, 4).goodput.tolist() != one.goodput.tolist()


def test_rsc_rates_give_its_job_mttfs_at_16_chips_a_node() -> None:
    one_k = fs.Scenario(nodes=64, node_mtbf_s=fs.rsc_node_mtbf_s(1024))
    sixteen_k = fs.Scenario(nodes=1024, node_mtbf_s=fs.rsc_node_mtbf_s(16384))
    assert 1 / one_k.job_rate == pytest.approx(7.9 * 3600)
    assert 1 / sixteen_k.job_rate == pytest.approx(1.8 * 3600)
    # the two imply different per-node rates: RSC's fit is not linear in the job's size
    assert fs.rsc_node_mtbf_s(16384) / fs.rsc_node_mtbf_s(1024) == pytest.approx(3.65, abs=0.01)
    assert fs.node_mtbf_for("rsc-16k", sixteen_k, 0.9) == fs.rsc_node_mtbf_s(16384)


def test_the_snapshot_interval_divides_the_durable_one_near_daly_s() -> None:
    step = fs.HLAT_STEP_S
    chosen = fs.snapshot_interval_s(6.3, 7.9 * 3600, step, 1000 * step) / step
    assert 1000 % round(chosen) == 0
    assert 0.7 < chosen * step / fs.daly_interval(6.3, 7.9 * 3600) < 1.3


@pytest.mark.parametrize(("build", "field"), [
    (lambda: fs.Snapshots(interval_s=0), "interval_s"),
    (lambda: fs.Snapshots(interval_s=10, block_s=-1), "block_s"),
    (lambda: fs.Snapshots(interval_s=10, peer_load_s=-1), "peer_load_s"),
    (lambda: fs.RecoveryPath("x", node_lost_detection_s=-5), "node_lost_detection_s"),
    (lambda: fs.rsc_node_mtbf_s(2048), "gpus"),
])
def test_path_bad_input_names_the_field(build: Callable[[], object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        build()


def test_cli_takes_the_rsc_rates(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--json", "--rate", "rsc-1k", "--runs", "3", "--days", "3",
                     "--sweep-points", "5"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["inputs"]["job_mtbf_s"] == pytest.approx(7.9 * 3600)
