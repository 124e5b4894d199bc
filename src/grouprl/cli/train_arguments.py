"""`grouprl train`'s flags: TRL's script and model arguments, every GRPOConfig field, and a YAML of defaults.

The parser refuses what it does not know, with the nearest flag or key named.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from typing import Any, Optional

import yaml


@dataclass
class ScriptArguments:
    """Where the data and rewards come from (TRL's `trl grpo` script arguments)."""

    dataset_name: Optional[str] = field(
        default=None,
        metadata={"help": "Hub dataset id, a local dataset directory, or a .json/.jsonl/.csv/.parquet file."},
    )
    dataset_config: Optional[str] = field(default=None, metadata={"help": "Dataset configuration name."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str = field(default="test", metadata={"help": "Split to evaluate on."})
    dataset_streaming: bool = field(default=False, metadata={"help": "Stream the dataset (needs --max_steps)."})
    reward_funcs: Optional[list[str]] = field(
        default=None, metadata={"help": "Reward functions: built-in names or dotted import paths (pkg.module.func)."}
    )
    reward_model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "A sequence-classification reward model (id or path), scored first."}
    )
    tools: Optional[list[str]] = field(
        default=None,
        metadata={
            "help": "grouprl extension: tool functions the model may call, as dotted import paths (pkg.module.func)."
        },
    )
    environment_factory: Optional[str] = field(
        default=None,
        metadata={
            "help": (
                "grouprl extension: dotted import path of an environment class or factory (its methods become tools)."
            )
        },
    )
    callbacks: Optional[list[str]] = field(
        default=None,
        metadata={
            "help": (
                "grouprl extension: transformers.TrainerCallback classes or instances, as dotted import paths "
                "(pkg.module.Callback)."
            )
        },
    )


@dataclass
class ModelArguments:
    """Which model to train (TRL's ModelConfig fields that grouprl supports)."""

    model_name_or_path: Optional[str] = field(default=None, metadata={"help": "Model id or local path."})
    model_revision: str = field(default="main", metadata={"help": "Model revision (branch, tag or commit)."})
    dtype: str = field(default="float32", metadata={"help": "Weights dtype: float32, bfloat16, float16 or auto."})
    attn_implementation: Optional[str] = field(
        default=None, metadata={"help": "Attention implementation (eager, sdpa, flash_attention_2, ...)."}
    )
    gguf_file: Optional[str] = field(
        default=None,
        metadata={
            "help": (
                "A GGUF file inside --model_name_or_path to train from (unpacked to dense weights; needs the gguf "
                "package). The saved model is an ordinary transformers checkpoint."
            )
        },
    )
    use_peft: bool = field(
        default=False, metadata={"help": "Train LoRA adapters (needs peft: pip install 'grouprl[peft]')."}
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA alpha (scaling = alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA path."})
    lora_target_modules: Optional[list[str]] = field(
        default=None,
        metadata={
            "help": (
                "Modules that get adapters (default: peft's choice for the architecture; 'all-linear' for every "
                "linear layer)."
            )
        },
    )
    lora_target_parameters: Optional[list[str]] = field(
        default=None,
        metadata={"help": "Parameters (not modules) that get adapters, e.g. MoE expert weights (peft >= 0.17)."},
    )
    lora_modules_to_save: Optional[list[str]] = field(
        default=None, metadata={"help": "Modules trained in full and saved with the adapter."}
    )
    lora_task_type: str = field(default="CAUSAL_LM", metadata={"help": "peft task type."})
    use_rslora: bool = field(default=False, metadata={"help": "Rank-stabilised LoRA (scaling = alpha / sqrt(r))."})
    use_dora: bool = field(default=False, metadata={"help": "Weight-decomposed LoRA (DoRA)."})
    load_in_8bit: bool = field(
        default=False, metadata={"help": "Load the base model in 8 bits (bitsandbytes); trains only with --use_peft."}
    )
    load_in_4bit: bool = field(
        default=False,
        metadata={"help": "Load the base model in 4 bits (bitsandbytes, QLoRA); trains only with --use_peft."},
    )
    bnb_4bit_quant_type: str = field(default="nf4", metadata={"help": "4-bit data type.", "choices": ["fp4", "nf4"]})
    use_bnb_nested_quant: bool = field(
        default=False, metadata={"help": "Quantize the 4-bit scales too (double quantization)."}
    )
    bnb_4bit_quant_storage: Optional[str] = field(
        default=None, metadata={"help": "dtype the packed 4-bit weights are stored in (unset: bitsandbytes' uint8)."}
    )

    def __post_init__(self) -> None:
        if self.load_in_8bit and self.load_in_4bit:
            raise ValueError("--load_in_8bit and --load_in_4bit are exclusive; pick one.")


def build_parser() -> Any:
    from transformers import HfArgumentParser
    from transformers.hf_argparser import string_to_bool

    from grouprl.config.grpo_config import GRPOConfig

    epilog = (
        "Several processes: --accelerate_config NAME (single_gpu, multi_gpu, zero1, zero2, zero3, fsdp2, or an "
        "accelerate YAML file) runs this command under `accelerate launch`; flags grouprl does not know "
        "(--num_processes, --num_machines, --machine_rank, --main_process_ip, ...) go to accelerate launch."
    )

    class TrainParser(HfArgumentParser):
        def error(self, message: str) -> None:
            """The error first and briefly: argparse would print the whole usage (every flag) before it."""
            import sys

            sys.stderr.write(f"{self.prog}: error: {message}\nSee `{self.prog} --help` for every flag.\n")
            sys.exit(2)

    parser = TrainParser(
        (ScriptArguments, GRPOConfig, ModelArguments),
        prog="grouprl train",
        description="Train a model with GRPO.",
        epilog=epilog,
        allow_abbrev=False,
    )  # a misspelt flag gets "did you mean", never a silent prefix match
    for action in parser._actions:  # HfArgumentParser gives Optional[bool] fields (bf16, tf32) no "flag alone"
        if action.type is string_to_bool and action.nargs is None:
            action.nargs, action.const = "?", True
    return parser


def parse_train_args(argv: list[str]) -> tuple[ScriptArguments, Any, ModelArguments]:
    parser = build_parser()
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, rest = pre.parse_known_args(argv)
    if known.config:
        with open(known.config, encoding="utf-8") as handle:
            values = yaml.safe_load(handle) or {}
        for key, value in (values.pop("env", None) or {}).items():
            os.environ[str(key)] = str(value)
        valid = {action.dest for action in parser._actions}
        unknown = sorted(set(values) - valid)
        if unknown:
            named = ", ".join(f"{key!r}{closest(key, valid, '(did you mean {}?)')}" for key in unknown)
            raise ValueError(
                f"{known.config}: unknown key{'s' if len(unknown) > 1 else ''} {named}. Every key must be a grouprl "
                "train flag (see grouprl train --help)."
            )
        parser.set_defaults(**values)
    script, config, model_args, remaining = parser.parse_args_into_dataclasses(args=rest, return_remaining_strings=True)
    if remaining:
        flags = {option for action in parser._actions for option in action.option_strings}
        flag = next((r for r in remaining if r.startswith("-")), remaining[0])
        parser.error(f"unrecognized argument {flag}.{closest(flag.split('=')[0], flags)}")
    return script, config, model_args


def closest(name: str, known: Any, say: str = "Did you mean {}?") -> str:
    """' Did you mean X?' (or `say` with X) for the known name nearest to a misspelt one, or ''."""
    import difflib

    match = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    return " " + say.format(match[0]) if match else ""
