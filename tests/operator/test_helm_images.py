"""No HLAT image is published anywhere, so the chart must never fall back to a name that no
registry has: `helm install` with no operator image is refused with the value to set (it used to
end in ImagePullBackOff on `hlat-operator:0.1.0`), and the README's EKS install, run as written,
names the images pushed to ECR just above it."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "hlat"


def _template(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), "template", "hlat", str(CHART), *args],
                          capture_output=True, text=True, timeout=120)


def _deployment(out: str) -> dict[str, Any]:
    (dep,) = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment"]
    return dep


def test_no_operator_image_is_refused_with_the_value_to_set(helm: Path) -> None:
    proc = _template(helm)
    assert proc.returncode != 0
    assert "image.repository is required" in proc.stderr
    assert "Dockerfile.operator" in proc.stderr


def test_no_replica_needs_no_image(helm: Path) -> None:
    """The local rig installs the chart for its RBAC only (replicaCount=0, hlat_testbed.chart)."""
    proc = _template(helm, "--set", "replicaCount=0")
    assert proc.returncode == 0, proc.stderr
    assert _deployment(proc.stdout)["spec"]["replicas"] == 0  # no pod to pull anything


def test_a_tag_in_the_repository_is_refused(helm: Path) -> None:
    proc = _template(helm, "--set", "image.repository=example.com/hlat-operator:1.0")
    assert proc.returncode != 0 and "image/repository" in proc.stderr


def _readme_helm_install() -> list[str]:
    """The `helm install` of README's "On EKS" section, with its shell variables filled in."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## On EKS", 1)[1].split("\n## ", 1)[0]
    (command,) = re.findall(r"^helm install hlat .*?(?<!\\)$", section, re.S | re.M)
    command = command.replace("\\\n", " ")
    for var, value in {"${REGISTRY}": "123456789012.dkr.ecr.us-west-2.amazonaws.com",
                       "${TAG}": "0.1.0"}.items():
        command = command.replace(var, value)
    assert "$" not in command, command
    argv = shlex.split(command)
    assert argv[:4] == ["helm", "install", "hlat", "charts/hlat"], argv
    return argv[4:]


def test_the_readme_install_names_the_images_it_pushed(helm: Path) -> None:
    args = [a for a in _readme_helm_install() if a != "--create-namespace"]
    proc = _template(helm, *args)
    assert proc.returncode == 0, proc.stderr
    container = _deployment(proc.stdout)["spec"]["template"]["spec"]["containers"][0]
    registry = "123456789012.dkr.ecr.us-west-2.amazonaws.com"
    assert container["image"] == f"{registry}/hlat-operator:0.1.0"
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["HLAT_OPERATOR_DEFAULT_IMAGE"] == f"{registry}/hlat-trainer:0.1.0"
    # and the README pushes exactly those repositories
    readme = (ROOT / "README.md").read_text()
    for repo in ("hlat-operator", "hlat-trainer"):
        assert f"aws ecr create-repository --repository-name {repo}" in readme, repo
        assert f"docker push ${{REGISTRY}}/{repo}:${{TAG}}" in readme, repo
