"""`grouprl demo`: GRPO on the built-in arithmetic task with the bundled tiny model."""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    from grouprl.demo.run import add_demo_arguments

    parser = argparse.ArgumentParser(
        prog="grouprl demo", description="GRPO on the built-in arithmetic task with the bundled tiny model."
    )
    add_demo_arguments(parser)
    return parser


def demo_command(argv: list[str]) -> int:
    from grouprl.demo.run import run_demo

    run_demo(build_parser().parse_args(argv))
    return 0
