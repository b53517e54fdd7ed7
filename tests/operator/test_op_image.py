"""The operator image's install, without a container engine: the lock it installs is current,
and installing it the way Dockerfile.operator does gives an environment where the operator
imports and starts, with none of the trainer's or the development tools' packages."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).parents[2]
LOCK = REPO / "operator" / "requirements.lock"
UV = REPO / ".tools" / "bin" / "uv"
EXPORT = ["export", "--frozen", "--no-dev", "--extra", "operator", "--no-emit-project",
          "--format", "requirements.txt"]


def test_the_operator_lock_is_uv_lock_s_operator_extra() -> None:
    out = subprocess.run([str(UV), *EXPORT, "-q", "-o", "/dev/stdout"], cwd=REPO, check=True,
                         capture_output=True, text=True).stdout
    pins = sorted(line for line in out.splitlines() if "==" in line)
    assert pins == sorted(line for line in LOCK.read_text().splitlines() if "==" in line), (
        f"stale: run `{UV} {' '.join(EXPORT)} -o operator/requirements.lock`")
    names = {line.split("==")[0] for line in pins}
    assert {"kopf", "kubernetes", "prometheus-client", "pydantic"} <= names
    assert not names & {"torch", "numpy", "pyarrow", "pytest", "ruff", "grafana-foundation-sdk"}


def test_dockerfile_installs_exactly_the_lock_and_smoke_tests_the_import() -> None:
    text = (REPO / "Dockerfile.operator").read_text()
    assert "--require-hashes --no-deps -r requirements.lock" in text
    assert "pip install --prefix=/install --no-deps ." in text
    assert 'python -c "import hlat_operator.cli' in text
    ignore = (REPO / "Dockerfile.operator.dockerignore").read_text().splitlines()
    assert ignore[ignore.index("*") + 1:].count("!operator/requirements.lock") == 1


@pytest.mark.slow
def test_the_locked_environment_runs_the_operator(tmp_path: Path) -> None:
    """What the image's build stage does, in a fresh virtual environment."""
    venv = tmp_path / "venv"
    subprocess.run([str(UV), "venv", "-q", "--python", "3.11", str(venv)], check=True)
    py = venv / "bin" / "python"
    pip = [str(UV), "pip", "install", "-q", "--python", str(py)]
    subprocess.run([*pip, "--require-hashes", "--no-deps", "-r", str(LOCK)], check=True)
    subprocess.run([*pip, "--no-deps", str(REPO)], check=True)
    check = subprocess.run(
        [str(py), "-c", "import hlat_operator.cli, hlat_operator.handlers, hlat_operator.leader\n"
         "import importlib.util as u\n"
         "print(','.join(m for m in ('torch', 'numpy', 'pytest') if u.find_spec(m)))"],
        capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    assert check.stdout.strip() == ""  # none of them
    helped = subprocess.run([str(venv / "bin" / "hlat-operator"), "--help"], capture_output=True,
                            text=True)
    assert helped.returncode == 0 and "--namespace" in helped.stdout
