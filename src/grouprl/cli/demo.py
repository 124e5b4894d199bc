"""`grouprl demo`: GRPO on the built-in arithmetic task with the bundled tiny model."""

from __future__ import annotations

import argparse


def demo_command(argv: list[str]) -> int:
    from grouprl.demo.run import add_demo_arguments, run_demo

    parser = argparse.ArgumentParser(
        prog="grouprl demo", description="GRPO on the built-in arithmetic task with the bundled tiny model."
    )
    add_demo_arguments(parser)
    run_demo(parser.parse_args(argv))
    return 0
