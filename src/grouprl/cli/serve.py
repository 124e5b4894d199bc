"""`grouprl serve`: a generation server for trainers."""

from __future__ import annotations

import argparse


def serve_command(argv: list[str]) -> int:
    from grouprl.generation.server import add_serve_arguments, serve

    parser = argparse.ArgumentParser(
        prog="grouprl serve",
        description="Serve a model for generation (OpenAI /v1/completions with "
        "token ids and logprobs) and accept weight updates from a grouprl trainer.",
    )
    add_serve_arguments(parser)
    serve(parser.parse_args(argv))
    return 0
