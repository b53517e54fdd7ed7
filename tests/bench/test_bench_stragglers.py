"""bench/bench_stragglers.py's scoring: what counts as a false flag and a miss."""

from __future__ import annotations

import bench_stragglers as sweep


def test_a_flag_on_a_healthy_node_or_under_the_threshold_is_false_and_a_miss_lowers_recall(
) -> None:
    trials = [
        {"node": "n1", "s": 0.3, "flags": {"n1": 25.0}},           # right
        {"node": None, "s": 0.0, "flags": {"n2": 30.0}},           # healthy trial: false
        {"node": "n2", "s": 0.1, "flags": {"n2": 28.0}},           # under the threshold: false
        {"node": "n3", "s": 0.2, "flags": {"n3": 31.0}},           # at it: right
        {"node": "n2", "s": 0.5, "flags": {"n2": 22.0, "n1": 29.0}},  # one right, one false
        {"node": "n3", "s": 0.5, "flags": {}},                     # a miss
    ]
    score = sweep.score(trials)
    assert (score["flags"], score["false"]) == (6, 3)
    assert score["precision"] == 0.5 and score["recall"] == 2 / 3
    goal = sweep.section(trials, 20, "cmd", []).goals[0]
    assert not goal.met and "50.0%" in goal.figures


def test_the_replace_goal_is_the_median_ratio_over_rounds() -> None:
    """After / healthy per round, its median against 1.05: one noisy round does not decide."""
    def move(healthy: float, after: float) -> dict[str, object]:
        return {"healthy": healthy, "slowed": 1.4 * healthy, "after": after, "latency": 40.0,
                "right": True}
    sec = sweep.section([], 20, "cmd", [move(0.2, 0.202), move(0.2, 0.26), move(0.2, 0.19)])
    goal = sec.goals[1]
    assert goal.met and "1.01x" in goal.figures and "1.30x" in sec.body
    worse = sweep.section([], 20, "cmd", [move(0.2, 0.22), move(0.2, 0.23), move(0.2, 0.19)])
    assert not worse.goals[1].met
