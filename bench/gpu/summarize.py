"""Summarize a pytest run for bench/gpu/check.sh: counts per test file, each failure's first line, skips by reason.

    python bench/gpu/summarize.py JUNIT_XML [PYTEST_LOG]

Without the JUnit file (pytest stopped at check.sh's time limit) it counts the verbose log's outcome lines and lists
its failures, then prints the log's last 20 lines.
"""

from __future__ import annotations

import collections
import os
import sys
import xml.etree.ElementTree as ET


def summarize(junit_path: str) -> str:
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    failures, skips = [], collections.Counter()
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        module = case.get("classname", "?").split(".")[-1]
        name = f"{module}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
                first = (child.get("message") or child.text or "").strip().splitlines()
                failures.append(f"{name}: {first[0][:300] if first else child.tag}")
            elif child.tag == "skipped":
                outcome = "skipped"
                skips[(child.get("message") or "").strip()[:200]] += 1
        counts[module][outcome] += 1
    total = sum(counts.values(), collections.Counter())
    lines = [f"{total['passed']} passed, {total['failed']} failed, {total['skipped']} skipped"]
    lines += [
        f"  {module}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped"
        for module, c in sorted(counts.items())
    ]
    if failures:
        lines += ["failures:"] + [f"  {line}" for line in failures]
    if skips:
        lines += ["skips by reason:"] + [f"  {n} x {reason}" for reason, n in skips.most_common()]
    return "\n".join(lines)


OUTCOMES = ("PASSED", "FAILED", "ERROR", "SKIPPED", "XFAIL", "XPASS")


def main(argv: list[str]) -> None:
    junit, log = argv[1], argv[2] if len(argv) > 2 else None
    if os.path.exists(junit):
        print(summarize(junit))
    elif log and os.path.exists(log):
        lines = open(log, encoding="utf-8", errors="replace").readlines()
        outcomes = collections.Counter(w for line in lines for w in line.split() if w in OUTCOMES)
        print(f"no {junit} (pytest did not finish); so far: " + ", ".join(f"{n} {w}" for w, n in outcomes.items()))
        print("".join(line for line in lines if " FAILED " in line or " ERROR " in line), end="")
        print("the log's end:\n" + "".join(lines[-20:]))
    else:
        print(f"neither {junit} nor a log to summarize")


if __name__ == "__main__":
    main(sys.argv)
