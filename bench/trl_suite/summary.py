"""Compares the two runs' per-test reports and writes results.json and results.md.

A test "passes" when pytest counts it a success: passed, or xfailed (an expected failure that
failed). It "fails" when it failed, errored, xpassed under ``strict=True`` (pytest reports that as
failed), or never ran because its module did not import.
"""

from __future__ import annotations

import json
from collections import Counter
from datetime import date
from pathlib import Path

PASS = {"passed", "xfailed"}
SKIP = {"skipped"}


def _key(nodeid: str) -> str:
    return nodeid[nodeid.index("tests/") + len("tests/") :] if "tests/" in nodeid else nodeid


def _load(paths) -> tuple[dict[str, dict], list[str]]:
    """One side's results; several report files (the suite split over processes) are merged."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    tests, shims = {}, []
    for path in paths:
        data = json.loads(Path(path).read_text())
        shims += [s for s in data.get("shims", []) if s not in shims]
        for nodeid, entry in data["tests"].items():
            if entry["outcome"] is None:  # set up, then interrupted before its call finished
                entry = {**entry, "outcome": "missing", "message": "interrupted (run stopped)"}
            if entry["outcome"] != "missing" or _key(nodeid) not in tests:
                tests[_key(nodeid)] = entry
        for nodeid in data.get("collected", []):  # collected but never reported: the run was stopped first
            tests.setdefault(
                _key(nodeid), {"outcome": "missing", "message": "not reached (run stopped)", "duration": 0.0}
            )
    return tests, shims


def verdict(outcome: str | None) -> str:
    if outcome == "missing":  # the run was stopped before reaching it
        return "notrun"
    if outcome in PASS:
        return "pass"
    if outcome in SKIP:
        return "skip"
    return "fail"


def compare(trl: dict[str, dict], grouprl: dict[str, dict]) -> list[dict]:
    rows = []
    for test in sorted(set(trl) | set(grouprl)):
        a, b = (
            trl.get(test, {"outcome": "missing", "message": ""}),
            grouprl.get(test, {"outcome": "missing", "message": ""}),
        )
        rows.append(
            {
                "test": test,
                "trl": a["outcome"],
                "trl_message": a["message"],
                "grouprl": b["outcome"],
                "grouprl_message": b["message"],
                "trl_seconds": round(a.get("duration", 0.0), 1),
                "grouprl_seconds": round(b.get("duration", 0.0), 1),
            }
        )
    return rows


def counts(rows: list[dict], side: str) -> dict[str, int]:
    tally = Counter(verdict(row[side]) for row in rows)
    return {
        "total": len(rows),
        "pass": tally["pass"],
        "skip": tally["skip"],
        "fail": tally["fail"],
        "not_run": tally["notrun"],
        "outcomes": dict(Counter(row[side] for row in rows)),
    }


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")[:220]


def write_summary(trl_report, grouprl_report, out: Path, source: str = "", notes: str = "") -> dict:
    """`trl_report` / `grouprl_report`: a report file each, or lists of them (sharded or resumed runs)."""
    trl, trl_shims = _load(trl_report)
    grouprl, grouprl_shims = _load(grouprl_report)
    rows = compare(trl, grouprl)
    regressions = [r for r in rows if verdict(r["trl"]) == "pass" and verdict(r["grouprl"]) == "fail"]
    gains = [r for r in rows if verdict(r["trl"]) == "fail" and verdict(r["grouprl"]) == "pass"]
    both_fail = [r for r in rows if verdict(r["trl"]) == "fail" and verdict(r["grouprl"]) == "fail"]
    result = {
        "date": date.today().isoformat(),
        "trl_tests_source": source,
        "notes": notes,
        "shims": sorted(set(trl_shims) | set(grouprl_shims)),
        "trl": counts(rows, "trl"),
        "grouprl": counts(rows, "grouprl"),
        "trl_pass_grouprl_fail": [r["test"] for r in regressions],
        "grouprl_pass_trl_fail": [r["test"] for r in gains],
        "both_fail": [r["test"] for r in both_fail],
        "tests": rows,
    }
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "results.md").write_text(render(result))
    return result


def render(result: dict) -> str:
    t, g = result["trl"], result["grouprl"]
    lines = [
        "# TRL's GRPO test suite against grouprl",
        "",
        f"Run {result['date']} with `python -m bench.trl_suite.run_suite` (see README.md): TRL's "
        "`tests/test_grpo_trainer.py` and `tests/test_rewards.py`, offline, on locally built stand-ins of its tiny "
        "Hub models and datasets; once with `trl` 1.16.0, once with only the import lines swapped to grouprl.",
        "",
        *([f"TRL's test files: {result['trl_tests_source']}.", ""] if result["trl_tests_source"] else []),
        *([result["notes"], ""] if result["notes"] else []),
        "| | tests | pass | skip | fail | not run |",
        "|---|---|---|---|---|---|",
        f"| TRL 1.16.0 | {t['total']} | {t['pass']} | {t['skip']} | {t['fail']} | {t['not_run']} |",
        f"| grouprl | {g['total']} | {g['pass']} | {g['skip']} | {g['fail']} | {g['not_run']} |",
        "",
        f"Pass under TRL, fail under grouprl: **{len(result['trl_pass_grouprl_fail'])}**. "
        f"Pass under grouprl, fail under TRL: {len(result['grouprl_pass_trl_fail'])}. "
        f"Fail under both: {len(result['both_fail'])}.",
        "",
        "Outcomes as pytest reports them — TRL: "
        + ", ".join(f"{k} {v}" for k, v in sorted(t["outcomes"].items()))
        + "; grouprl: "
        + ", ".join(f"{k} {v}" for k, v in sorted(g["outcomes"].items()))
        + ".",
        "",
        "Environment adaptations applied to both runs (bench/trl_suite/suite_conftest.py): "
        + "; ".join(f"`{s}`" for s in result["shims"])
        + ".",
        "",
        "## Pass under TRL, fail under grouprl",
        "",
        "| test | grouprl outcome | first error line |",
        "|---|---|---|",
    ]
    by_name = {r["test"]: r for r in result["tests"]}
    for name in result["trl_pass_grouprl_fail"]:
        r = by_name[name]
        lines.append(f"| `{name}` | {r['grouprl']} | {_cell(r['grouprl_message'])} |")
    if result["grouprl_pass_trl_fail"]:
        lines += [
            "",
            "## Pass under grouprl, fail under TRL",
            "",
            "| test | TRL outcome | TRL's first error line |",
            "|---|---|---|",
        ]
        for name in result["grouprl_pass_trl_fail"]:
            r = by_name[name]
            lines.append(f"| `{name}` | {r['trl']} | {_cell(r['trl_message'])} |")
    lines += [
        "",
        "## Fail under both",
        "",
        "| test | TRL: first error line | grouprl: first error line |",
        "|---|---|---|",
    ]
    for name in result["both_fail"]:
        r = by_name[name]
        lines.append(
            f"| `{name}` | {r['trl']}: {_cell(r['trl_message'])} | {r['grouprl']}: {_cell(r['grouprl_message'])} |"
        )
    lines += ["", "## Every test", "", "| test | TRL | grouprl | grouprl's first error line |", "|---|---|---|---|"]
    for r in result["tests"]:
        message = r["grouprl_message"] if verdict(r["grouprl"]) != "pass" else ""
        lines.append(f"| `{r['test']}` | {r['trl']} | {r['grouprl']} | {_cell(message)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    # python -m bench.trl_suite.summary TRL_REPORT[,MORE] GROUPRL_REPORT[,MORE] OUT_DIR [SOURCE [NOTES]]
    import sys

    write_summary(sys.argv[1].split(","), sys.argv[2].split(","), Path(sys.argv[3]), *sys.argv[4:6])
