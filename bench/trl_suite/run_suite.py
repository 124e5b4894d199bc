"""Runs TRL's own GRPO tests offline, once against TRL and once with the import swapped to grouprl.

    python -m bench.trl_suite.run_suite --trl-tests /path/to/trl-checkout [--python /work/trl-venv/bin/python]

``--trl-tests`` is a checkout (or copy) of TRL's repository, or just its ``tests`` folder, holding
``test_grpo_trainer.py``, ``test_rewards.py`` and ``testing_utils.py`` (see README.md for where to get
them; TRL's files are never copied into this repository). ``--python`` is an environment with
``trl==1.16.0`` and its test requirements; grouprl is made importable there through PYTHONPATH.

Steps: build the stand-in models/datasets into ``<work>/hf_home`` (once), copy the test files into
``<work>/suite-trl/tests`` and ``<work>/suite-grouprl/tests`` (the latter with the import lines in
``IMPORT_SWAPS`` rewritten), run pytest in each with ``HF_HOME`` pointing at the stand-ins and the Hub
offline, then write the comparison (``summary.py``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
TEST_FILES = ("test_grpo_trainer.py", "test_rewards.py")
SUPPORT_FILES = ("testing_utils.py",)

# The only edits made for the grouprl run: what a user changes to switch libraries.
IMPORT_SWAPS = {
    "test_grpo_trainer.py": [
        ("from trl import GRPOConfig, GRPOTrainer\n", "from grouprl import GRPOConfig, GRPOTrainer\n")
    ],
    "test_rewards.py": [("from trl.rewards import (\n", "from grouprl.rewards import (\n")],
}


def find_tests_dir(path: Path) -> Path:
    for candidate in (path / "tests", path):
        if all((candidate / name).is_file() for name in TEST_FILES + SUPPORT_FILES):
            return candidate
    raise SystemExit(
        f"--trl-tests {path}: no folder there (or its tests/) holds {', '.join(TEST_FILES + SUPPORT_FILES)}"
    )


def prepare_suite(source: Path, target: Path, swap: bool) -> None:
    tests = target / "tests"
    if tests.exists():
        shutil.rmtree(tests)
    tests.mkdir(parents=True)
    (tests / "__init__.py").write_text("")
    shutil.copy(HERE / "suite_conftest.py", tests / "conftest.py")
    for name in SUPPORT_FILES:
        shutil.copy(source / name, tests / name)
    for name in TEST_FILES:
        text = (source / name).read_text()
        if swap:
            for old, new in IMPORT_SWAPS[name]:
                if text.count(old) != 1:
                    raise SystemExit(
                        f"{name}: expected exactly one line {old.strip()!r} to swap, found {text.count(old)}"
                    )
                text = text.replace(old, new)
        (tests / name).write_text(text)


def build_standins(python: str, hf_home: Path, rebuild: bool) -> None:
    if rebuild and hf_home.exists():
        shutil.rmtree(hf_home)
    # Builds only the parts its stamp (standins.json) does not list yet: nothing, once all are built.
    subprocess.run([python, "-m", "bench.trl_suite.standins", str(hf_home)], cwd=REPO, check=True)


def suite_env(hf_home: Path, report: Path, grouprl_src: Path | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HF_TOKEN")}
    env.update(
        HF_HOME=str(hf_home),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        TRL_SUITE_REPORT=str(report),
        OMP_NUM_THREADS=env.get("OMP_NUM_THREADS", "1"),
        HF_DATASETS_CACHE=str(hf_home / "datasets"),
    )
    if grouprl_src is not None:
        env["PYTHONPATH"] = str(grouprl_src)
    return env


def collect(python: str, suite: Path, hf_home: Path, grouprl_src: Path | None, extra: list[str]) -> list[str]:
    """The suite's test ids, in run order (relative to the suite folder)."""
    command = [
        python,
        "-m",
        "pytest",
        *[f"tests/{name}" for name in TEST_FILES],
        "-p",
        "no:cacheprovider",
        "--collect-only",
        "-q",
        *extra,
    ]
    done = subprocess.run(
        command, cwd=suite, env=suite_env(hf_home, suite / "collect.json", grouprl_src), capture_output=True, text=True
    )
    ids = [line[line.index("tests/") :] for line in done.stdout.splitlines() if "::" in line and "tests/" in line]
    if not ids:
        raise SystemExit(f"collection in {suite} found no tests:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return ids


def run_pytest(
    python: str,
    suite: Path,
    hf_home: Path,
    report: Path,
    grouprl_src: Path | None,
    timeout: int,
    extra: list[str],
    tests: list[str] | None = None,
    log_name: str = "pytest.log",
) -> subprocess.Popen:
    targets = tests if tests is not None else [f"tests/{name}" for name in TEST_FILES]
    command = [
        python,
        "-m",
        "pytest",
        *targets,
        "-p",
        "no:cacheprovider",
        f"--timeout={timeout}",
        "-q",
        "-rN",
        "--tb=line",
        *extra,
    ]
    log = open(suite / log_name, "w")
    return subprocess.Popen(
        command, cwd=suite, env=suite_env(hf_home, report, grouprl_src), stdout=log, stderr=subprocess.STDOUT
    )


def start_suite(
    python: str, suite: Path, hf_home: Path, grouprl_src: Path | None, timeout: int, extra: list[str], shards: int
) -> list[tuple[subprocess.Popen, Path]]:
    """One pytest process, or `shards` processes over contiguous slices of the collected tests (the training
    tests are CPU-bound and single-threaded, so slices finish in a fraction of the time on a busy machine)."""
    if shards <= 1:
        report = suite / "report.json"
        return [(run_pytest(python, suite, hf_home, report, grouprl_src, timeout, extra), report)]
    ids = collect(python, suite, hf_home, grouprl_src, extra)
    size = -(-len(ids) // shards)
    started = []
    for index in range(0, len(ids), size):
        report = suite / f"report-{index // size}.json"
        started.append(
            (
                run_pytest(
                    python,
                    suite,
                    hf_home,
                    report,
                    grouprl_src,
                    timeout,
                    extra,
                    ids[index : index + size],
                    f"pytest-{index // size}.log",
                ),
                report,
            )
        )
    return started


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-tests", required=True, type=Path, help="TRL checkout, or its tests/ folder")
    parser.add_argument(
        "--python", default="/work/trl-venv/bin/python", help="interpreter of the environment with trl==1.16.0"
    )
    parser.add_argument("--grouprl-src", type=Path, default=REPO / "src", help="folder holding the grouprl package")
    parser.add_argument(
        "--work", type=Path, default=HERE / ".cache", help="stand-ins, suite copies and logs (git-ignored)"
    )
    parser.add_argument("--out", type=Path, default=HERE, help="where results.json and results.md are written")
    parser.add_argument("--only", choices=("both", "trl", "grouprl"), default="both")
    parser.add_argument(
        "--sequential", action="store_true", help="run the two suites one after the other (default: side by side)"
    )
    parser.add_argument("--timeout", type=int, default=300, help="per-test timeout in seconds")
    parser.add_argument(
        "--shards", type=int, default=1, help="pytest processes per suite, over contiguous slices of its tests"
    )
    parser.add_argument("--rebuild-standins", action="store_true")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --), e.g. -k training")
    args = parser.parse_args(argv)

    source = find_tests_dir(args.trl_tests.resolve())
    work = args.work.resolve()
    hf_home = work / "hf_home"
    build_standins(args.python, hf_home, args.rebuild_standins)

    runs = [name for name in ("trl", "grouprl") if args.only in ("both", name)]
    started, processes, reports = time.time(), {}, {}
    for name in runs:
        suite = work / f"suite-{name}"
        prepare_suite(source, suite, swap=(name == "grouprl"))
        launched = start_suite(
            args.python,
            suite,
            hf_home,
            args.grouprl_src.resolve() if name == "grouprl" else None,
            args.timeout,
            args.pytest_args,
            args.shards,
        )
        processes[name] = [process for process, _ in launched]
        reports[name] = [report for _, report in launched]
        if args.sequential:
            for process in processes[name]:
                process.wait()
    for name in runs:
        codes = [process.wait() for process in processes[name]]
        print(f"{name}: pytest exit code(s) {codes}; logs and reports in {work / f'suite-{name}'}")
    print(f"wall time {time.time() - started:.0f} s")

    from .summary import write_summary

    if set(reports) == {"trl", "grouprl"} and all(path.exists() for paths in reports.values() for path in paths):
        write_summary(reports["trl"], reports["grouprl"], args.out, source=str(source))
        print(f"wrote {args.out / 'results.json'} and {args.out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
