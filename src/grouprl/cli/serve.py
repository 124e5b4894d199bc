"""`grouprl serve`: a generation server for trainers."""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    from grouprl.generation.server import add_serve_arguments

    parser = argparse.ArgumentParser(
        prog="grouprl serve",
        description="Serve a model for generation (OpenAI /v1/completions with "
        "token ids and logprobs) and accept weight updates from a grouprl trainer.",
    )
    add_serve_arguments(parser)
    return parser


def serve_command(argv: list[str]) -> int:
    from grouprl.generation.server import serve

    serve(build_parser().parse_args(argv))
    return 0
