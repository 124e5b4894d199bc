"""`grouprl train`: mirrors `trl grpo`, from flags to a trained and saved model."""

from __future__ import annotations

import os
from typing import Any

from grouprl.cli.train_arguments import parse_train_args
from grouprl.cli.train_inputs import (
    import_dotted,
    load_train_dataset,
    lora_config,
    quantization_config,
    resolve_reward_function,
)


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
            f"grouprl: model saved to {config.output_dir}; metrics in "
            f"{os.path.join(config.output_dir, 'metrics.jsonl')} (charts: grouprl report {config.output_dir})"
        )
    if config.push_to_hub:
        trainer.push_to_hub(dataset_name=script.dataset_name)  # as trl grpo: the dataset goes into the model card
    trainer.end()  # finish the trackers and the process group, as trl grpo does last
    return 0
