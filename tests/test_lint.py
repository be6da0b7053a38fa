"""The code stays clean under the project's ruff rules and formatter (pyproject.toml), so CI catches drift."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_ruff_check_is_clean():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--output-format", "concise", str(ROOT)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_leaves_the_code_as_it_is():
    """ruff is pinned to one minor version (pyproject.toml): its formatter's style changes between them."""
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", str(ROOT)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


LAYERS = ("core", "workload", "runtime", "profiler", "cli")
"""monet_cli's packages, lowest first: each may import only itself, those below it and ``errors``."""


def _imports(path: Path) -> set[str]:
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def test_no_import_runs_back_up_the_layers():
    wrong = []
    for rank, layer in enumerate(LAYERS):
        allowed = {f"monet_cli.{name}" for name in LAYERS[: rank + 1]} | {"monet_cli.errors"}
        for path in sorted((ROOT / "monet_cli" / layer).rglob("*.py")):
            for module in _imports(path):
                package = ".".join(module.split(".")[:2])
                if module.startswith("monet_cli.") and package not in allowed:
                    wrong.append(f"{path.relative_to(ROOT)} imports {module}")
                if layer == "core" and module.split(".")[0] in ("torch", "typer", "rich"):
                    wrong.append(f"{path.relative_to(ROOT)} imports {module} (the core is pure)")
    assert not wrong, "\n".join(wrong)
