"""The layout stays readable: one-way imports (import-linter's contracts in pyproject.toml), no import cycle
inside src/, small modules, short functions."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers.cli import ROOT, cli_env

SRC = ROOT / "src" / "zerotune"
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 500, 80


def lint_imports(src_root: Path) -> subprocess.CompletedProcess:
    env = {**cli_env(), "PYTHONPATH": str(src_root)}
    return subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--config", str(ROOT / "pyproject.toml"),
                           "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def type_check(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(Path(sys.executable).parent / "mypy"), "--config-file", str(ROOT / "pyproject.toml"),
                           "--cache-dir", "/dev/null" if args else str(ROOT / ".mypy_cache"), *args], cwd=cwd,
                          env=cli_env(), capture_output=True, text=True, timeout=600)


def test_src_passes_the_type_checker():
    """Every module under src/ (pyproject.toml's [tool.mypy] files), with 0 errors. The cache in .mypy_cache
    keeps a run after the first to a second or less."""
    proc = type_check(ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:]
    checked = int(re.search(r"in (\d+) source files", proc.stdout)[1])
    assert checked >= len(list((ROOT / "src").rglob("*.py"))), proc.stdout


def test_the_type_checker_catches_a_config_read_as_a_dict(tmp_path):
    """Not vacuous: a block of the resolved config read with DictConfig's .get is an error."""
    bad = tmp_path / "bad.py"
    bad.write_text("from zerotune.config.schema import Config\n\n\ndef seed(cfg: Config) -> int:\n"
                   "    return cfg.train.get('seed')\n")
    proc = type_check(ROOT, str(bad))
    assert proc.returncode != 0 and '"Train" has no attribute "get"' in proc.stdout, proc.stdout


def test_import_contracts_are_kept():
    proc = lint_imports(ROOT / "src")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "0 broken" in proc.stdout


def test_an_upward_import_breaks_the_contract(tmp_path):
    """The contract is not vacuous: models importing the launcher is reported."""
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "zerotune", copy / "zerotune", ignore=shutil.ignore_patterns("__pycache__"))
    models = copy / "zerotune" / "models" / "__init__.py"
    models.write_text(models.read_text() + "\nimport zerotune.job.parent  # noqa\n")
    proc = lint_imports(copy)
    assert proc.returncode != 0 and "zerotune.models -> zerotune.job.parent" in proc.stdout


# Every strongly connected set of src/'s modules (Tarjan's), from grimp's graph: imports inside functions and
# under TYPE_CHECKING count too. Run on the tree's own src/, as lint-imports is.
CYCLES = """
import json, sys
import grimp

graph = grimp.build_graph("zerotune", "hydra_plugins", include_external_packages=False)
ours = sorted(m for m in graph.modules if m.split(".")[0] == "zerotune" or m.startswith("hydra_plugins.zerotune_"))
edges = {m: sorted(n for n in graph.find_modules_directly_imported_by(m) if n in ours and n != m) for m in ours}
index, low, stack, on_stack, found = {}, {}, [], set(), []
sys.setrecursionlimit(10000)

def visit(m):
    index[m] = low[m] = len(index)
    stack.append(m)
    on_stack.add(m)
    for n in edges[m]:
        if n not in index:
            visit(n)
            low[m] = min(low[m], low[n])
        elif n in on_stack:
            low[m] = min(low[m], index[n])
    if low[m] == index[m]:
        group = []
        while True:
            n = stack.pop()
            on_stack.discard(n)
            group.append(n)
            if n == m:
                break
        if len(group) > 1:
            found.append(sorted(group))

for m in ours:
    if m not in index:
        visit(m)
print(json.dumps(sorted(found)))
"""


def import_cycles(src_root: Path) -> list[list[str]]:
    env = {**cli_env(), "PYTHONPATH": str(src_root)}
    proc = subprocess.run([sys.executable, "-c", CYCLES], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def test_no_import_cycle_inside_src():
    cycles = import_cycles(ROOT / "src")
    assert not cycles, "import cycles (each a set of modules that import one another):\n" + "\n".join(
        " <-> ".join(group) for group in cycles)


def test_an_import_cycle_is_found(tmp_path):
    """The check is not vacuous: an import inside a function that closes a loop is reported."""
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "src", copy, ignore=shutil.ignore_patterns("__pycache__"))
    errors = copy / "zerotune" / "config" / "errors.py"
    errors.write_text(errors.read_text() + "\n\ndef _late():\n    import zerotune.job.parent  # noqa\n")
    assert any("zerotune.config.errors" in group and "zerotune.job.parent" in group for group in import_cycles(copy))


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
