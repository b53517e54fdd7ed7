"""The chart's alert rules, checked and unit-tested by promtool (built with Prometheus from its
Go module), and shipped unchanged in the PrometheusRule."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.slow]

HERE = Path(__file__).parent
RULES = HERE.parents[1] / "charts" / "hlat" / "files" / "alerts.yaml"


def test_the_rules_are_valid(promtool: Path) -> None:
    proc = subprocess.run([str(promtool), "check", "rules", str(RULES)], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "8 rules found" in proc.stdout


def test_each_alert_fires_when_it_should_and_not_before(promtool: Path) -> None:
    proc = subprocess.run([str(promtool), "test", "rules", "alerts_test.yaml"], cwd=HERE,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tested = {t["alertname"] for case in yaml.safe_load((HERE / "alerts_test.yaml").read_text())
              ["tests"] for t in case["alert_rule_test"]}
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert tested == alerts


def test_the_prometheus_rule_ships_the_tested_rules(helm: Path) -> None:
    out = subprocess.run(
        [str(helm), "template", "hlat", str(HERE.parents[1] / "charts" / "hlat"),
         "--set", "prometheusRule.enabled=true", "--set", "image.repository=hlat-operator",
         "--api-versions", "monitoring.coreos.com/v1/PrometheusRule"],
        check=True, capture_output=True, text=True).stdout
    (rule,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "PrometheusRule"]
    assert rule["spec"] == yaml.safe_load(RULES.read_text())
