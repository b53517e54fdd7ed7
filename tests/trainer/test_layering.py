"""The model file stays a pure nn.Module: it imports no distributed code (import-linter cannot
forbid a subpackage of an external package, so this checks the imports themselves)."""

from __future__ import annotations

import ast
from pathlib import Path

import hlat_trainer.model


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def test_model_imports_no_distributed_code() -> None:
    names = imported_modules(Path(hlat_trainer.model.__file__))
    assert "torch" in names  # the check reads real imports
    offending = {n for n in names if n.startswith(("torch.distributed", "torch.nn.parallel"))}
    assert not offending, offending
