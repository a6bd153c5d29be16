"""The layout stays readable: one-way imports (import-linter's contracts in pyproject.toml), small modules,
short functions."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers.cli import ROOT, cli_env

SRC = ROOT / "src" / "zerotune"
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 300, 40


def lint_imports(src_root: Path) -> subprocess.CompletedProcess:
    env = {**cli_env(), "PYTHONPATH": str(src_root)}
    return subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--config", str(ROOT / "pyproject.toml"),
                           "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_import_contracts_are_kept():
    proc = lint_imports(ROOT / "src")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "0 broken" in proc.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    """The contract is not vacuous: models importing the launcher is reported."""
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "zerotune", copy / "zerotune", ignore=shutil.ignore_patterns("__pycache__"))
    models = copy / "zerotune" / "models" / "__init__.py"
    models.write_text(models.read_text() + "\nimport zerotune.launch.job  # noqa\n")
    proc = lint_imports(copy)
    assert proc.returncode != 0 and "zerotune.models -> zerotune.launch.job" in proc.stdout


def _functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_modules_and_functions_stay_small():
    too_long = []
    for file in sorted(SRC.rglob("*.py")):
        text = file.read_text()
        name = file.relative_to(SRC)
        if text.count("\n") > MAX_MODULE_LINES:
            too_long.append(f"{name}: {text.count(chr(10))} lines")
        for fn in _functions(ast.parse(text)):
            length = fn.end_lineno - fn.lineno + 1
            if length > MAX_FUNCTION_LINES:
                too_long.append(f"{name}:{fn.lineno} {fn.name}: {length} lines")
    assert not too_long, "\n".join(too_long)
