"""What `grouprl train`'s flags name, built: reward functions, tools, datasets, LoRA and quantization configs."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Callable, Optional

from grouprl.cli.train_arguments import ModelArguments, ScriptArguments, closest
from grouprl.model.loading import looks_like_local_path


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
    targets = model_args.lora_target_modules
    if targets is not None and list(targets) == ["all-linear"]:  # peft's keyword is a string, not a module name
        targets = "all-linear"
    return require_peft().LoraConfig(
        task_type=model_args.lora_task_type,
        r=model_args.lora_r,
        lora_alpha=model_args.lora_alpha,
        lora_dropout=model_args.lora_dropout,
        target_modules=targets,
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
    known = sorted([*BUILTIN_REWARDS, *CONFIGURED_REWARDS])
    raise ValueError(
        f"--reward_funcs {name}: not a built-in reward ({', '.join(known)}) and not a dotted path pkg.module.func."
        f"{closest(name, known)}"
    )


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
        public = [n for n in dir(module) if not n.startswith("_")]
        hint = closest(attribute, public, f"Did you mean {module_name}.{{}}?")
        raise ValueError(f"{flag} {name}: module {module_name!r} has no attribute {attribute!r}.{hint}")
    return getattr(module, attribute)


def load_train_dataset(script: ScriptArguments, split: Optional[str] = None) -> Any:
    """The train split (or `split`) of --dataset_name. A single data file has only a train split."""
    import datasets

    name = script.dataset_name
    split = split or script.dataset_train_split
    if name is None:
        raise ValueError("grouprl train needs --dataset_name (a Hub id, a local dataset directory or a data file).")
    check_local_dataset_exists(name)
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


DATA_FILE_EXTENSIONS = (".json", ".jsonl", ".csv", ".parquet", ".txt", ".arrow")


def check_local_dataset_exists(name: str) -> None:
    """A --dataset_name that is a data file (by its extension) or a local path must exist: otherwise `datasets`
    looks it up on the Hub and answers that it cannot reach it, hiding a typo in the file name."""
    local = name.lower().endswith(DATA_FILE_EXTENSIONS) or looks_like_local_path(name)
    if not local or os.path.exists(name):
        return
    folder = os.path.dirname(os.path.abspath(name))
    hint = ""
    if os.path.isdir(folder):
        import difflib

        close = difflib.get_close_matches(os.path.basename(name), sorted(os.listdir(folder)), n=1, cutoff=0.6)
        hint = f" Did you mean {os.path.join(os.path.dirname(name), close[0])}?" if close else ""
    raise FileNotFoundError(
        f"--dataset_name {name}: no such file or directory ({os.path.abspath(name)}).{hint} Check the path (a relative "
        f"one starts from the current directory, {os.getcwd()}); a Hub dataset id (owner/name) has no file extension."
    )
