"""The job dashboard's Neuron panels show the selected job's own nodes, not every Trainium node
that neuron-monitor runs on: on a node pool shared by several jobs, another job's idle or failing
devices would otherwise sit on this job's dashboard.

Checked twice: on the generated JSON (each Neuron panel's query carries the job filter), and by
promtool evaluating each query over made-up neuron-monitor and kube-state-metrics series for two
jobs on two nodes (only this job's instance comes back)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from hlat_operator import dashboards

CHART = Path(__file__).resolve().parents[2] / "charts" / "hlat"


def _neuron_exprs(board: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            names = set(re.findall(r"\b([a-z_][a-z0-9_]*)(?=\{|\[)", target["expr"]))
            if names & dashboards.NEURON_MONITOR_METRICS:
                out.append((panel["title"], target["expr"]))
    return out


def test_every_neuron_panel_query_is_filtered_to_the_jobs_nodes() -> None:
    board = json.loads((CHART / dashboards.dashboard_file("hlat-job")).read_text())
    exprs = _neuron_exprs(board)
    assert len(exprs) >= 4, exprs  # utilisation, memory, execution errors, ECC
    for title, expr in exprs:
        assert "and on (instance_id)" in expr, title
        assert 'created_by_name=~"$pretrainjob"' in expr, title
        assert 'namespace=~"$namespace"' in expr, title
    fleet = json.loads((CHART / dashboards.dashboard_file("hlat-fleet")).read_text())
    assert not _neuron_exprs(fleet)  # no job variable there to filter by


# Two jobs in team-a: "llama" on node-1 (instance i-0aaa), "other" on node-2 (i-0bbb); both nodes
# run neuron-monitor. Label sets as the exporters write them (pod-metrics.md, node-metrics.md).
SERIES = [
    ('kube_pod_info{namespace="team-a",pod="llama-a0-0",node="ip-10-0-0-1.ec2.internal",'
     'created_by_kind="PretrainJob",created_by_name="llama"}', "1x20"),
    ('kube_pod_info{namespace="team-a",pod="other-a0-0",node="ip-10-0-0-2.ec2.internal",'
     'created_by_kind="PretrainJob",created_by_name="other"}', "1x20"),
    ('kube_node_info{node="ip-10-0-0-1.ec2.internal",provider_id="aws:///us-west-2a/i-0aaa"}',
     "1x20"),
    ('kube_node_info{node="ip-10-0-0-2.ec2.internal",provider_id="aws:///us-west-2a/i-0bbb"}',
     "1x20"),
]
for _instance in ("i-0aaa", "i-0bbb"):
    _labels = f'instance_id="{_instance}",instance_type="trn1.32xlarge",neuroncore="0"'
    SERIES += [
        (f"neuroncore_utilization_ratio{{{_labels}}}", "0.5x20"),
        (f"neuron_runtime_memory_used_bytes{{{_labels}}}", "1000x20"),
        (f"execution_errors_total{{{_labels}}}", "0+1x20"),
        (f"hardware_ecc_events_total{{{_labels}}}", "0+1x20"),
    ]


def _instantiate(expr: str) -> str:
    return (expr.replace("$namespace", "team-a").replace("$pretrainjob", "llama")
            .replace("$__rate_interval", "5m"))


@pytest.mark.slow
def test_promtool_returns_only_the_selected_jobs_instance(promtool: Path, tmp_path: Path
                                                          ) -> None:
    cases = [{"expr": f"count by (instance_id) ({_instantiate(expr)})", "eval_time": "15m",
              "exp_samples": [{"labels": '{instance_id="i-0aaa"}', "value": 1}]}
             for _, panel, expr in dashboards.queries() if panel.hardware]
    assert len(cases) >= 4
    spec = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in SERIES],
        "promql_expr_test": cases}]}
    (tmp_path / "neuron_test.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    proc = subprocess.run([str(promtool), "test", "rules", "neuron_test.yaml"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
