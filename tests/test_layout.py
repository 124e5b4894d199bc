"""The package's shape is checked, not only described: layers (import-linter), no import cycles (type-only imports
too), lint and format (ruff). What one training step runs through is checked in test_step_structure.py.
docs/architecture.md explains the layers."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "grouprl"
BIN = Path(sys.executable).parent


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


def import_circles(exclude_type_checking_imports: bool) -> set[tuple[str, ...]]:
    """The package's import circles: each a strongly connected set of modules (sorted names) of more than one
    module, the re-exporting root left out."""
    import grimp

    graph = grimp.build_graph("grouprl", exclude_type_checking_imports=exclude_type_checking_imports, cache_dir=None)
    imports = {m: sorted(set(graph.find_modules_directly_imported_by(m)) - {"grouprl"}) for m in graph.modules}
    reaches = {m: set() for m in imports}  # m -> every module it imports, directly or not
    for module in imports:
        todo = list(imports[module])
        while todo:
            m = todo.pop()
            if m not in reaches[module]:
                reaches[module].add(m)
                todo.extend(imports.get(m, ()))
    return {
        tuple(sorted({module} | {m for m in reaches[module] if module in reaches[m]}))
        for module in imports
        if module in reaches[module]
    }


def test_no_import_cycles():
    assert import_circles(exclude_type_checking_imports=True) == set()


def test_no_import_cycles_through_type_checking_imports_either():
    assert import_circles(exclude_type_checking_imports=False) == set()


def test_ruff_lint_and_format():
    lint = run_tool("ruff", "check", "src", "tests", "bench", "examples")
    assert lint.returncode == 0, lint.stdout[-4000:]
    form = run_tool("ruff", "format", "--check", "src", "tests", "bench", "examples")
    assert form.returncode == 0, form.stdout[-4000:]
