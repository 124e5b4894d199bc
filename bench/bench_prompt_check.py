"""What the up-front prompt check costs (data/prompts.check_every_prompt_fits): every prompt of a Dataset tokenized
through the chat template and checked against the context before the first step, at most TOKEN_CHECK_SECONDS.

    python bench/bench_prompt_check.py                  # 20,000 rows, plain and conversational, the demo tokenizer
    python bench/bench_prompt_check.py --rows 100000

Prints one JSON line per prompt kind: rows checked, seconds, microseconds a row, and how many rows the budget covers
at that rate, with the CPU's flags.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src"))
import datasets  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from workloads import cpu_flags  # noqa: E402

from grouprl.data.prompts import TOKEN_CHECK_SECONDS, PromptTokenizer, check_every_prompt_fits  # noqa: E402
from grouprl.demo.model import DEMO_MODEL_DIR  # noqa: E402


def prompt(i: int, conversational: bool):
    question = f"What is {i} + {i % 97}? Think step by step, then give the number."
    if not conversational:
        return question
    return [{"role": "system", "content": "You are a careful solver."}, {"role": "user", "content": question}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=20_000)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))
    for conversational in (False, True):
        dataset = datasets.Dataset.from_dict({"prompt": [prompt(i, conversational) for i in range(args.rows)]})
        check = PromptTokenizer(tokenizer, max_context=1_000_000, max_completion_length=256)
        started = time.perf_counter()
        rows = check_every_prompt_fits(check, dataset, budget_s=10 * TOKEN_CHECK_SECONDS)
        seconds = time.perf_counter() - started
        print(
            json.dumps(
                {
                    "bench": "prompt_check",
                    "kind": "conversational" if conversational else "plain",
                    "rows": rows,
                    "seconds": round(seconds, 3),
                    "us_per_row": round(seconds / rows * 1e6, 1),
                    "rows_in_budget": int(TOKEN_CHECK_SECONDS / (seconds / rows)),
                    "budget_s": TOKEN_CHECK_SECONDS,
                    "cpu": cpu_flags(),
                }
            )
        )


if __name__ == "__main__":
    main()
