"""The package's shape is checked, not only described: layers (import-linter), no import cycles, module size,
lint and format (ruff). docs/architecture.md explains the layers."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "grouprl"
BIN = Path(sys.executable).parent
MAX_MODULE_LINES = 300


def run_tool(name: str, *args: str, pythonpath: Path = ROOT / "src") -> subprocess.CompletedProcess:
    tool = BIN / name
    if not tool.exists():
        pytest.skip(f"{name} is not installed (pip install -e '.[dev]')")
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run([str(tool), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_layers_contract_is_kept():
    result = run_tool("lint-imports")
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_layers_contract_fails_when_a_lower_layer_imports_a_higher_one(tmp_path):
    copy = tmp_path / "src"
    shutil.copytree(SRC, copy / "grouprl", ignore=shutil.ignore_patterns("__pycache__"))
    kl = copy / "grouprl" / "core" / "kl.py"
    kl.write_text(kl.read_text() + "\nfrom grouprl.train import loop  # noqa: E402,F401\n")
    result = run_tool("lint-imports", pythonpath=copy)
    assert result.returncode != 0
    assert "grouprl.core.kl -> grouprl.train.loop" in result.stdout


def test_no_import_cycles():
    import grimp

    graph = grimp.build_graph("grouprl", exclude_type_checking_imports=True)
    modules = sorted(m for m in graph.modules if m != "grouprl")  # the root re-exports the public API
    cycles = []
    for module in modules:
        for imported in graph.find_modules_directly_imported_by(module):
            if imported != "grouprl" and graph.chain_exists(importer=imported, imported=module):
                cycles.append((module, imported))
    assert not cycles, f"import cycles: {cycles}"


def test_no_module_is_over_the_size_limit():
    sizes = {str(p.relative_to(SRC)): sum(1 for _ in p.open(encoding="utf-8")) for p in SRC.rglob("*.py")}
    over = {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines (split them by job): {over}"


def test_ruff_lint_and_format():
    lint = run_tool("ruff", "check", "src", "tests", "bench", "examples")
    assert lint.returncode == 0, lint.stdout[-4000:]
    form = run_tool("ruff", "format", "--check", "src", "tests", "bench", "examples")
    assert form.returncode == 0, form.stdout[-4000:]
