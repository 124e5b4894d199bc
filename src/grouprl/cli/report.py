"""`grouprl report OUTPUT_DIR`: an HTML report of a run."""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grouprl report", description="Write a self-contained HTML report (and PNG charts) of a run."
    )
    parser.add_argument("output_dir", help="The run's output_dir (holds metrics.jsonl).")
    parser.add_argument(
        "--out", default=None, help="Where to write index.html and the PNGs (default: OUTPUT_DIR/report)."
    )
    return parser


def report_command(argv: list[str]) -> int:
    from grouprl.report.writer import write_report

    args = build_parser().parse_args(argv)
    report = write_report(args.output_dir, args.out)
    drawn = [key for key, png in report.charts.items() if png]
    print(f"grouprl report: {report.html} ({len(drawn)} of {len(report.charts)} charts drawn; PNGs next to it)")
    return 0
