"""`grouprl serve`: a generation server for trainers."""

from __future__ import annotations

import argparse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grouprl serve",
        description="Serve a model for generation (OpenAI /v1/completions with "
        "token ids and logprobs) and accept weight updates from a grouprl trainer.",
    )
    add_serve_arguments(parser)
    return parser


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Model id or local path (AutoModelForCausalLM).")
    parser.add_argument("--host", default="0.0.0.0", help="Address to listen on (default 0.0.0.0).")
    parser.add_argument("--port", type=int, default=8000, help="Port (default 8000, as vllm_server_port).")
    parser.add_argument(
        "--dtype", default="auto", help="Weights dtype: auto, float32, bfloat16, float16 (default auto)."
    )
    parser.add_argument("--device", default=None, help="Device (default: cuda if available, else cpu).")
    parser.add_argument(
        "--seed", type=int, default=0, help="Sampling seed at start-up (a request's seed overrides it)."
    )
    parser.add_argument(
        "--generation_engine",
        default="auto",
        choices=["auto", "engine", "captured", "transformers"],
        help="What samples a text model (default auto: on a CPU the fast engine, else the captured decode loop; "
        "on CUDA the captured decode loop; where they serve the model, else transformers generate; a "
        "vision-language model always samples with transformers generate).",
    )
    parser.add_argument("--trust_remote_code", action="store_true", help="Allow custom model code.")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice).")
    parser.add_argument(
        "--weight_version", type=int, default=0, help="Version of the weights served at start-up (default 0)."
    )
    parser.add_argument(
        "--parent_pid", type=int, default=None, help="Exit when this process ends (a trainer's own worker)."
    )
    parser.add_argument("--log_level", default="warning", help="uvicorn log level (default warning).")


def serve_command(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)  # before the server's imports: `--help` and a bad flag answer at once
    from grouprl.generation.server import serve
    from grouprl.model.loading import check_local_model_path

    check_local_model_path(args.model)

    serve(args)
    return 0
