"""`grouprl train --accelerate_config NAME ...`: start the training on several processes with
`accelerate launch`, as `trl grpo` does.

NAME is a bundled config (single_gpu, multi_gpu, zero1, zero2, zero3, fsdp2) or a path to an
accelerate YAML file. Flags that `grouprl train` does not know (`--num_processes 8`,
`--num_machines 2 --machine_rank 0 --main_process_ip ...`) go to `accelerate launch`; the rest
go to `grouprl train` in each process:

    accelerate launch --config_file <NAME.yaml> [unknown flags] -m grouprl.cli train [grouprl flags]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import Optional

CONFIG_DIR = os.path.join(os.path.dirname(__file__), "accelerate_configs")


def bundled_configs() -> list[str]:
    return sorted(name[: -len(".yaml")] for name in os.listdir(CONFIG_DIR) if name.endswith(".yaml"))


def resolve_accelerate_config(name: str) -> str:
    """Path of a bundled config name, or of an existing YAML file."""
    if os.path.isfile(name):
        return os.path.abspath(name)
    path = os.path.join(CONFIG_DIR, f"{name}.yaml")
    if os.path.isfile(path):
        return path
    raise ValueError(
        f"--accelerate_config {name}: neither a bundled config ({', '.join(bundled_configs())}) nor a YAML file."
    )


def launch_command(argv: list[str]) -> Optional[list[str]]:
    """The `accelerate launch` command line for `grouprl train ARGV`, or None without --accelerate_config."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--accelerate_config", "--accelerate-config", dest="accelerate_config")
    known, rest = pre.parse_known_args(argv)
    if not known.accelerate_config or "-h" in rest or "--help" in rest:
        return None
    from grouprl.cli.train_arguments import build_parser

    parser = build_parser()
    parser.add_argument("--config")  # the YAML defaults file, read by each process
    _, unknown = parser.parse_known_args(rest)
    train_flags, launcher_flags = split_in_order(rest, unknown)
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        resolve_accelerate_config(known.accelerate_config),
        *launcher_flags,
        "-m",
        "grouprl.cli",
        "train",
        *train_flags,
    ]


def split_in_order(args: list[str], unknown: list[str]) -> tuple[list[str], list[str]]:
    """Split `args` into (the others, `unknown`), where `unknown` is an ordered sub-sequence of `args`."""
    others, taken = [], 0
    for arg in args:
        if taken < len(unknown) and arg == unknown[taken]:
            taken += 1
        else:
            others.append(arg)
    return others, list(unknown)


def run_launch(command: list[str]) -> int:
    print("grouprl: " + " ".join(command), flush=True)
    return subprocess.run(command, check=False).returncode
