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

import argparse
import importlib
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

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
            "help": "grouprl extension: dotted import path of an environment class or factory (its methods become tools)."
        },
    )
    callbacks: Optional[list[str]] = field(
        default=None,
        metadata={
            "help": "grouprl extension: transformers.TrainerCallback classes or instances, as dotted import paths (pkg.module.Callback)."
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
            "help": "A GGUF file inside --model_name_or_path to train from (unpacked to dense weights; needs the gguf package). The saved model is an ordinary transformers checkpoint."
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
            "help": "Modules that get adapters (default: peft's choice for the architecture; 'all-linear' for every linear layer)."
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
        default=None, metadata={"help": "dtype the packed 4-bit weights are stored in (default: uint8)."}
    )

    def __post_init__(self) -> None:
        if self.load_in_8bit and self.load_in_4bit:
            raise ValueError("--load_in_8bit and --load_in_4bit are exclusive; pick one.")


def lora_config(model_args: ModelArguments) -> Any:
    """--use_peft: the LoraConfig `trl grpo` builds from the same flags (None without --use_peft)."""
    if not model_args.use_peft:
        return None
    from grouprl.model.adapters import require_peft

    extra = (
        {"target_parameters": model_args.lora_target_parameters}
        if model_args.lora_target_parameters is not None
        else {}
    )
    return require_peft().LoraConfig(
        task_type=model_args.lora_task_type,
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=model_args.lora_target_modules,
        bias="none",
        modules_to_save=model_args.lora_modules_to_save,
        use_rslora=model_args.use_rslora,
        use_dora=model_args.use_dora,
        **extra,
    )


def quantization_config(model_args: ModelArguments) -> Any:
    """--load_in_4bit / --load_in_8bit: the BitsAndBytesConfig `trl grpo` builds from the same flags (else None).

    As TRL, the 4-bit layers compute in --dtype, the dtype of the other weights.
    """
    if not (model_args.load_in_4bit or model_args.load_in_8bit):
        return None
    from transformers import BitsAndBytesConfig

    if model_args.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    if model_args.dtype == "auto":
        raise ValueError(
            "--load_in_4bit computes in --dtype, so --dtype auto is not enough: name it (float32, bfloat16 or float16)."
        )
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_compute_dtype=model_args.dtype,
        bnb_4bit_quant_type=model_args.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=model_args.use_bnb_nested_quant,
        bnb_4bit_quant_storage=model_args.bnb_4bit_quant_storage,
    )


def resolve_reward_function(name: str, config: Any = None) -> Callable:
    """A built-in reward name or a dotted import path (the current directory is importable).

    Factories that need the run's settings (``get_cosine_scaled_reward``: max_len =
    max_completion_length) are built from ``config``.
    """
    from grouprl.rewards import BUILTIN_REWARDS, CONFIGURED_REWARDS

    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    if name in CONFIGURED_REWARDS:
        if config is None:
            from grouprl.config.grpo_config import GRPOConfig

            config = GRPOConfig()
        return CONFIGURED_REWARDS[name](config)
    if "." in name:
        return import_dotted(name, "--reward_funcs")
    names = ", ".join(sorted([*BUILTIN_REWARDS, *CONFIGURED_REWARDS]))
    raise ValueError(f"--reward_funcs {name}: not a built-in reward ({names}) and not a dotted path pkg.module.func.")


def import_dotted(name: str, flag: str) -> Any:
    """The attribute named by a dotted path pkg.module.attr (the current directory is importable)."""
    module_name, _, attribute = name.rpartition(".")
    if not module_name:
        raise ValueError(f"{flag} {name}: not a dotted import path pkg.module.attr.")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"{flag} {name}: cannot import module {module_name!r} ({err}).") from None
    if not hasattr(module, attribute):
        raise ValueError(f"{flag} {name}: module {module_name!r} has no attribute {attribute!r}.")
    return getattr(module, attribute)


def load_train_dataset(script: ScriptArguments, split: Optional[str] = None) -> Any:
    """The train split (or `split`) of --dataset_name. A single data file has only a train split."""
    import datasets

    name = script.dataset_name
    split = split or script.dataset_train_split
    if name is None:
        raise ValueError("grouprl train needs --dataset_name (a Hub id, a local dataset directory or a data file).")
    extension = os.path.splitext(name)[1].lstrip(".")
    single = (os.path.isfile(name) and extension in ("json", "jsonl", "csv", "parquet")) or (
        os.path.isdir(name) and os.path.exists(os.path.join(name, "dataset_info.json"))
    )
    if single and split != script.dataset_train_split:
        raise ValueError(
            f"--dataset_name {name} holds a single split, so it has no {split!r} split to evaluate on; use a "
            "DatasetDict directory or Hub id with that split, or --eval_strategy no."
        )
    if os.path.isfile(name) and extension in ("json", "jsonl", "csv", "parquet"):
        builder = "json" if extension == "jsonl" else extension
        return datasets.load_dataset(builder, data_files=name, split="train", streaming=script.dataset_streaming)
    if os.path.isdir(name) and os.path.exists(os.path.join(name, "dataset_dict.json")):
        return datasets.load_from_disk(name)[split]
    if os.path.isdir(name) and os.path.exists(os.path.join(name, "dataset_info.json")):
        return datasets.load_from_disk(name)
    return datasets.load_dataset(name, script.dataset_config, split=split, streaming=script.dataset_streaming)


def build_parser() -> Any:
    from transformers import HfArgumentParser

    from grouprl.config.grpo_config import GRPOConfig

    epilog = (
        "Several processes: --accelerate_config NAME (single_gpu, multi_gpu, zero1, zero2, zero3, fsdp2, or an accelerate YAML "
        "file) runs this command under `accelerate launch`; flags grouprl does not know (--num_processes, --num_machines, "
        "--machine_rank, --main_process_ip, ...) go to accelerate launch."
    )
    return HfArgumentParser(
        (ScriptArguments, GRPOConfig, ModelArguments),
        prog="grouprl train",
        description="Train a model with GRPO.",
        epilog=epilog,
        allow_abbrev=False,
    )  # a misspelt flag gets "did you mean", never a silent prefix match


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
            raise ValueError(
                f"{known.config}: unknown key {unknown[0]!r}.{closest(unknown[0], valid)} Every key must be a grouprl "
                "train flag (see grouprl train --help)."
            )
        parser.set_defaults(**values)
    script, config, model_args, remaining = parser.parse_args_into_dataclasses(args=rest, return_remaining_strings=True)
    if remaining:
        flags = {option for action in parser._actions for option in action.option_strings}
        flag = next((r for r in remaining if r.startswith("-")), remaining[0])
        parser.error(
            f"unrecognized argument {flag}.{closest(flag.split('=')[0], flags)} See grouprl train --help for every flag."
        )
    return script, config, model_args


def closest(name: str, known: Any) -> str:
    """' Did you mean X?' for the known name nearest to a misspelt one, or ''."""
    import difflib

    match = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.75)
    return f" Did you mean {match[0]}?" if match else ""


def train_command(argv: list[str]) -> int:
    from grouprl.launch import launch_command, run_launch

    command = launch_command(argv)
    if command is not None:  # --accelerate_config: re-run this command under accelerate launch
        return run_launch(command)
    script, config, model_args = parse_train_args(argv)
    from grouprl.compat.trainer import GRPOTrainer

    if model_args.model_name_or_path is None:
        raise ValueError("grouprl train needs --model_name_or_path.")
    reward_funcs: list[Any] = [resolve_reward_function(name, config) for name in script.reward_funcs or []]
    if script.reward_model_name_or_path:
        reward_funcs.insert(0, script.reward_model_name_or_path)  # as trl grpo: the reward model comes first
    if not reward_funcs and not script.environment_factory:
        raise ValueError(
            "grouprl train needs at least one --reward_funcs (a built-in name or a dotted path pkg.module.func) "
            "or a --reward_model_name_or_path."
        )
    tools = [import_dotted(name, "--tools") for name in script.tools or []]
    environment_factory = (
        import_dotted(script.environment_factory, "--environment_factory") if script.environment_factory else None
    )
    callbacks = [import_dotted(name, "--callbacks") for name in script.callbacks or []]
    init_kwargs = {"revision": model_args.model_revision, "dtype": model_args.dtype}
    if model_args.attn_implementation:
        init_kwargs["attn_implementation"] = model_args.attn_implementation
    if model_args.gguf_file:
        init_kwargs["gguf_file"] = model_args.gguf_file
    config.model_init_kwargs = {**init_kwargs, **(config.model_init_kwargs or {})}
    eval_dataset = load_train_dataset(script, script.dataset_test_split) if config.eval_strategy != "no" else None
    trainer = GRPOTrainer(
        model=model_args.model_name_or_path,
        reward_funcs=reward_funcs,
        args=config,
        train_dataset=load_train_dataset(script),
        eval_dataset=eval_dataset,
        tools=tools or None,
        environment_factory=environment_factory,
        callbacks=callbacks,
        quantization_config=quantization_config(model_args),
        peft_config=lora_config(model_args),
    )
    trainer.train(resume_from_checkpoint=config.resume_from_checkpoint)
    trainer.save_model(config.output_dir)
    if trainer.accelerator.is_main_process:
        print(
            f"grouprl: model saved to {config.output_dir}; metrics in {os.path.join(config.output_dir, 'metrics.jsonl')} "
            f"(charts: grouprl report {config.output_dir})"
        )
    if config.push_to_hub:
        trainer.push_to_hub(dataset_name=script.dataset_name)  # as trl grpo: the dataset goes into the model card
    trainer.end()  # finish the trackers and the process group, as trl grpo does last
    return 0


def demo_command(argv: list[str]) -> int:
    from grouprl.demo.run import add_demo_arguments, run_demo

    parser = argparse.ArgumentParser(
        prog="grouprl demo", description="GRPO on the built-in arithmetic task with the bundled tiny model."
    )
    add_demo_arguments(parser)
    run_demo(parser.parse_args(argv))
    return 0


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


def report_command(argv: list[str]) -> int:
    from grouprl.report import write_report

    parser = argparse.ArgumentParser(
        prog="grouprl report", description="Write a self-contained HTML report (and PNG charts) of a run."
    )
    parser.add_argument("output_dir", help="The run's output_dir (holds metrics.jsonl).")
    parser.add_argument(
        "--out", default=None, help="Where to write index.html and the PNGs (default: OUTPUT_DIR/report)."
    )
    args = parser.parse_args(argv)
    report = write_report(args.output_dir, args.out)
    drawn = [key for key, png in report.charts.items() if png]
    print(f"grouprl report: {report.html} ({len(drawn)} of {len(report.charts)} charts drawn; PNGs next to it)")
    return 0


COMMANDS = {"train": train_command, "serve": serve_command, "demo": demo_command, "report": report_command}


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
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
