"""Command line: ``grouprl train`` (mirrors ``trl grpo``), ``grouprl serve``, ``grouprl demo`` and ``grouprl report``.

    grouprl train --model_name_or_path PATH --dataset_name NAME_OR_FILE --reward_funcs NAME_OR_DOTTED_PATH ...
    grouprl train --config run.yaml --learning_rate 1e-5      # YAML sets defaults, flags override
    grouprl train --accelerate_config multi_gpu --num_processes 8 ...   # several processes via accelerate launch
    grouprl serve --model PATH --port 8000                     # a generation server for trainers
    grouprl demo                                               # the built-in arithmetic task, ~2 minutes on a CPU
    grouprl report OUTPUT_DIR                                  # HTML page with charts and completions of a run

Every GRPOConfig field is a flag (``--snake_case`` or ``--kebab-case``).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Optional

# each command's module, imported when that command runs: `grouprl --help` imports none, `grouprl serve` not the trainer
COMMANDS = {
    "train": "grouprl.cli.train",
    "serve": "grouprl.cli.serve",
    "demo": "grouprl.cli.demo",
    "report": "grouprl.cli.report",
}


# what bad input raises (a missing path, a bad value, a bad row, a full disk): printed as the message alone
USER_ERRORS = (ValueError, TypeError, OSError, ImportError)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(
            "usage: grouprl {train,serve,demo,report} [flags]\n\n"
            "  train   train a model with GRPO (grouprl train --help lists every flag)\n"
            "  serve   serve a model for generation to trainers (grouprl serve --help)\n"
            "  demo    run the built-in default: GRPO on small arithmetic with a bundled tiny model\n"
            "  report  write an HTML report of a run: grouprl report OUTPUT_DIR"
        )
        return 0 if argv and argv[0] in ("-h", "--help") else (2 if argv else 0)
    command = getattr(importlib.import_module(COMMANDS[argv[0]]), f"{argv[0]}_command")
    if os.environ.get("GROUPRL_TRACEBACK"):
        return command(argv[1:])
    try:
        return command(argv[1:])
    except USER_ERRORS as err:  # the library's own messages name the flag, field or file: two lines, no traceback
        print(f"grouprl {argv[0]}: {type(err).__name__}: {err}", file=sys.stderr)
        print(f"(the traceback: GROUPRL_TRACEBACK=1 grouprl {argv[0]} ...)", file=sys.stderr)
        return 1
