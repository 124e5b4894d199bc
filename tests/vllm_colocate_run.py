"""Run by tests/test_vllm_cpu.py under a Python that has vLLM (its CPU build): TRL's quick start with
use_vllm=True, vllm_mode="colocate", as `python script.py` (no launcher variables set) or under `accelerate launch`
(one vLLM engine in each process). After every weight sync it asks vLLM for the log-probabilities of a fixed sequence
and compares them with the trainer's model; each process writes what it saw to OUTPUT_DIR/result-rank<r>.json.

    python vllm_colocate_run.py MODEL_DIR OUTPUT_DIR {full,lora,dynamic,gfpo,sync_ref,rollout_func}

The variants besides full and lora train with dynamic sampling, GFPO's filter, a synced reference, or a rollout_func
that samples through trainer.generation_backend (the vLLM engine).
"""

import json
import os
import sys

import torch


def reward_num_unique_chars(completions, **kwargs):
    return [len(set(c)) for c in completions]


FIXED = [5, 17, 42, 9, 33, 8, 21, 60, 3, 14, 27, 50]  # token ids scored after every sync


def vllm_logprobs(llm, vllm) -> torch.Tensor:
    params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    (output,) = llm.generate([{"prompt_token_ids": FIXED}], params, use_tqdm=False)
    return torch.tensor([step[token].logprob for step, token in zip(output.prompt_logprobs[1:], FIXED[1:])])


def trainer_logprobs(model) -> torch.Tensor:
    ids = torch.tensor([FIXED], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits.float()[0, :-1]
    return logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0].cpu()


def main(model_dir: str, output_dir: str, variant: str) -> None:
    import vllm
    from datasets import Dataset

    from grouprl import GFPOConfig, GFPOTrainer, GRPOConfig, GRPOTrainer
    from grouprl.compat.gfpo import shortest_k_filter

    dataset = Dataset.from_dict({"prompt": ["The sky is", "Once upon a time", "def add(a, b):", "Hello"]})
    options = {
        "dynamic": {"dynamic_sampling": True, "max_dynamic_sampling_rounds": 2},
        "gfpo": {"num_remains_in_group": 2},
        "sync_ref": {"beta": 0.1, "sync_ref_model": True, "ref_model_sync_steps": 1},
    }.get(variant, {})
    args = (GFPOConfig if variant == "gfpo" else GRPOConfig)(
        output_dir=output_dir,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_enable_sleep_mode=False,  # vLLM's CPU build has no sleep mode (docs/scaling.md)
        vllm_max_model_length=128,
        max_steps=3,
        logging_steps=1,
        learning_rate=0.2 if variant == "lora" else 0.05,  # weights that move: a missed sync shows
        max_completion_length=16,
        per_device_train_batch_size=4,
        num_generations=4,
        report_to="none",
        bf16=False,
        seed=0,
        **options,
    )
    peft_config = None
    if variant == "lora":
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
    extra = {"group_filter_func": shortest_k_filter} if variant == "gfpo" else {}
    if variant == "rollout_func":
        from helpers import sample_through_the_backend  # beside this script

        extra = {"rollout_func": sample_through_the_backend}
    trainer = (GFPOTrainer if variant == "gfpo" else GRPOTrainer)(
        model=model_dir,
        reward_funcs=reward_num_unique_chars,
        args=args,
        train_dataset=dataset,
        peft_config=peft_config,
        **extra,
    )
    backend = trainer.generation_backend
    real_sync, syncs = backend.sync_weights, []

    def checked_sync(model):
        real_sync(model)
        ours, theirs = trainer_logprobs(model), vllm_logprobs(backend.llm, vllm)
        syncs.append({"trainer": ours.tolist(), "vllm": theirs.tolist(), "gap": float((ours - theirs).abs().max())})

    backend.sync_weights = checked_sync
    trainer.train()
    history = trainer.state.log_history
    unwrapped = trainer.accelerator.unwrap_model(trainer.run.model)
    weights = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in unwrapped.parameters()]
    os.makedirs(output_dir, exist_ok=True)
    result = os.path.join(output_dir, f"result-rank{trainer.accelerator.process_index}.json")
    with open(result, "w", encoding="utf-8") as handle:
        json.dump(
            {
                "processes": trainer.accelerator.num_processes,
                "sharded": any(hasattr(p, "full_tensor") for p in unwrapped.parameters()),
                "checksum": sum(w.double().sum().item() for w in weights),
                "syncs": syncs,
                "losses": [e["loss"] for e in history if "loss" in e],
                "sampler_gap": [e.get("sampling/sampling_logp_difference/max") for e in history if "loss" in e],
                "vllm_dtype": str(backend.llm.llm_engine.model_config.dtype),
                "reloads_in_place": backend.reloads_in_place,
                "vllm": vllm.__version__,
            },
            handle,
        )


if __name__ == "__main__":  # vLLM spawns its engine process
    main(*sys.argv[1:])
