"""Run by tests/test_vllm_cpu.py under a Python that has vLLM (its CPU build): TRL's quick start with
use_vllm=True, vllm_mode="colocate", as `python script.py` (no launcher variables set) or under `accelerate launch`
(one vLLM engine in each process). After every weight sync it asks vLLM for the log-probabilities of a fixed sequence
and compares them with the trainer's model; each process writes what it saw to OUTPUT_DIR/result-rank<r>.json.

    python vllm_colocate_run.py MODEL_DIR OUTPUT_DIR VARIANT
    (VARIANT: full, lora, qlora, dynamic, gfpo, sync_ref, rollout_func, tools, environment, images or tool_images)

qlora loads the policy in 4 bits (vLLM is sent the base dequantized with the adapters' update added). The variants
besides full, lora and qlora train with dynamic sampling, GFPO's filter, a synced reference, a rollout_func
that samples through trainer.generation_backend (the vLLM engine), or tools / an environment_factory: in those, the
first turn of every even sample calls the tool (`FirstTurnCallsTheTool`) and vLLM samples the turns after the tool's
result. images trains a vision-language model (MODEL_DIR an Idefics3) on image prompts and scores one image prompt
in vLLM and in the trainer after a last sync (`image_gaps`). tool_images gives that model image prompts and a tool
that returns an image (`look`): vLLM samples the turn after it with the prompt's image and the tool's.
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


class FirstTurnCallsTheTool:
    """The vLLM backend, except that the first turn of every even sample is `call` (token ids of a tool call, which a
    random tiny model never writes), with the logprobs vLLM gives those tokens, as if it had sampled them. Turns after
    a tool's result are vLLM's own; `continuations` keeps their prompts, one per continued sample."""

    needs_importance_correction = True

    def __init__(self, real, tokenizer, call: list[int]):
        import vllm

        self.real, self.tokenizer, self.call, self.vllm = real, tokenizer, call, vllm
        self.continuations: list[str] = []
        self.continued: list[tuple] = []  # (prompt ids, image inputs) of the turns after a tool's result

    def sync_weights(self, model):
        self.real.sync_weights(model)

    def generate(self, prompt_ids, num_samples, params, multimodal=None):
        from grouprl.core.types import Completion

        completions = self.real.generate(prompt_ids, num_samples, params, multimodal=multimodal)
        if "<tool_response>" in self.tokenizer.decode(prompt_ids[0]):
            self.continuations += [self.tokenizer.decode(ids) for ids in prompt_ids for _ in range(num_samples)]
            self.continued += list(zip(prompt_ids, multimodal or [None] * len(prompt_ids)))
            return completions
        for i, completion in enumerate(completions):
            if i % num_samples % 2 == 0:
                b = completion.prompt_index
                logprobs = self.scored(prompt_ids[b], self.call, None if multimodal is None else multimodal[b])
                text = self.tokenizer.decode(self.call, skip_special_tokens=True)
                completions[i] = Completion(completion.prompt_index, list(self.call), text, "stop", logprobs)
        return completions

    def scored(self, prompt: list[int], tokens: list[int], images=None) -> list[float]:
        from grouprl.generation.vllm import engine_prompts

        params = self.vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        (request,) = engine_prompts([prompt + tokens], None if images is None else [images])
        (output,) = self.real.llm.generate([request], params, use_tqdm=False)
        start = len(output.prompt_token_ids) - len(tokens)
        return [output.prompt_logprobs[start + k][token].logprob for k, token in enumerate(tokens)]


def look() -> list:
    """Show the picture the question is about."""
    from vlm_models import image  # beside this script

    return [{"type": "image", "image": image(7, 32, 32)}, {"type": "text", "text": "here it is"}]


def image_gaps(trainer, sync, llm, vllm) -> dict:
    """After training and a sync, one image prompt and 4 tokens after it scored by vLLM (from the placeholders it
    expands) and by the trainer's model (from the processor's ids and pixels), the most they differ: with the prompt's
    image, and with another image given to vLLM (how much the image moves the scores, so a dropped image would
    show). The image is one the run sampled with, whose embeddings vLLM cached before the sync."""
    from vlm_models import image

    processor = trainer.processing_class
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=[text], images=[[image(0, 32, 32)]], return_tensors="pt")
    tail = [5, 17, 42, 9]
    ids = inputs["input_ids"][0].tolist() + tail
    model = trainer.accelerator.unwrap_model(trainer.run.model)
    sync(model)  # the last step's update, which no generation has synced yet
    with torch.no_grad():
        pixels = {k: v for k, v in inputs.items() if k not in ("input_ids", "attention_mask")}
        logits = model(input_ids=torch.tensor([ids]), **pixels).logits[0, :-1].float()
    ours = logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    placeholders = processor.tokenizer(text, add_special_tokens=False)["input_ids"] + tail
    params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    gaps = {}
    for name, seed in (("same", 0), ("other", 8)):
        prompt = {"prompt_token_ids": placeholders, "multi_modal_data": {"image": [image(seed, 32, 32)]}}
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        assert list(output.prompt_token_ids) == ids, "vLLM expanded the placeholders unlike the processor"
        theirs = torch.tensor([step[token].logprob for step, token in zip(output.prompt_logprobs[1:], ids[1:])])
        gaps[name] = float((ours - theirs).abs().max())
    return gaps


def tool_image_gaps(trainer, sync, llm, vllm, continued) -> dict:
    """After training and a sync, the prompt of a turn after a tool's image scored by vLLM (from the placeholders it
    expands, with the prompt's images and the tool's) and by the trainer's model (from the rollout's ids and processor
    outputs), the most they differ: as sampled, and with a blank image in the tool's place given to vLLM."""
    from dataclasses import replace

    from grouprl.generation.vllm import engine_prompts
    from grouprl.model.multimodal import collate

    ids, images = continued[0]
    model = trainer.accelerator.unwrap_model(trainer.run.model)
    sync(model)  # the last step's update, which no generation has synced yet
    with torch.no_grad():
        inputs = collate([images], len(ids), len(ids))
        logits = model(input_ids=torch.tensor([ids]), **inputs).logits[0, :-1].float()
    ours = logits.log_softmax(-1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
    params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
    gaps = {}
    from PIL import Image

    blank = Image.new("RGB", (32, 32), "white")
    for name, tool_image in (("same", images.images[-1]), ("other", blank)):
        (prompt,) = engine_prompts([ids], [replace(images, images=[*images.images[:-1], tool_image])])
        (output,) = llm.generate([prompt], params, use_tqdm=False)
        assert list(output.prompt_token_ids) == list(ids), "vLLM expanded the placeholders unlike the processor"
        theirs = torch.tensor([step[token].logprob for step, token in zip(output.prompt_logprobs[1:], ids[1:])])
        gaps[name] = float((ours - theirs).abs().max())
    return gaps


def reward_num_unique_characters_of_the_conversation(completions, **kwargs):
    return [len(set(str(c))) for c in completions]


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
    agents = variant in ("tools", "environment", "tool_images")
    images = variant == "images"
    if images or variant == "tool_images":
        from vlm_models import image  # beside this script

        prompts = [[{"role": "user", "content": f"What is in picture {i}?"}] for i in range(4)]
        # two images over three steps, so one comes back after a sync (vLLM caches an image's embeddings); prompts of
        # one image and of both
        pictures = [[image(0, 32, 32)], [image(1, 32, 32), image(0, 32, 32)], [image(1, 32, 32)], [image(0, 32, 32)]]
        dataset = Dataset.from_dict({"prompt": prompts, "images": pictures})
    if variant in ("tools", "environment"):
        dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": f"{i} times 7?"}] for i in range(4)]})
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
        vllm_max_model_length=256 if agents else 128,
        max_steps=3,
        logging_steps=1,
        # weights that move: a missed sync shows (agents' longer rows move them further)
        learning_rate={"lora": 0.2, "qlora": 0.2, "tools": 0.02, "environment": 0.02, "tool_images": 0.02}.get(
            variant, 0.05
        ),
        max_completion_length=136 if agents else 16,  # a call (75 tokens), its result (44), 17 tokens after it
        per_device_train_batch_size=4,
        num_generations=4,
        report_to="none",
        bf16=False,
        seed=0,
        **options,
    )
    peft_config = None
    if variant in ("lora", "qlora"):
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0)
    extra = {"group_filter_func": shortest_k_filter} if variant == "gfpo" else {}
    if variant == "qlora":
        extra["quantization_config"] = {"load_in_4bit": True}
    if variant == "tool_images":
        from transformers import AutoProcessor
        from vlm_models import with_tool_template

        processor = AutoProcessor.from_pretrained(model_dir)
        processor.tokenizer.image_markup = "<image>"  # Idefics3's image block (tests/vlm_models.py)
        tokenizer = with_tool_template(processor).tokenizer
        extra = {"tools": [look], "processing_class": processor}
    elif agents:
        from helpers import Counter, multiply  # beside this script
        from transformers import AutoTokenizer

        from grouprl.demo.tokenizer import COMPACT_TOOL_CHAT_TEMPLATE

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        tokenizer.chat_template = COMPACT_TOOL_CHAT_TEMPLATE
        extra = {"tools": [multiply]} if variant == "tools" else {"environment_factory": Counter}
        extra["processing_class"] = tokenizer
    if variant == "rollout_func":
        from helpers import sample_through_the_backend  # beside this script

        extra = {"rollout_func": sample_through_the_backend}
    trainer = (GFPOTrainer if variant == "gfpo" else GRPOTrainer)(
        model=model_dir,
        reward_funcs=reward_num_unique_characters_of_the_conversation if agents or images else reward_num_unique_chars,
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
    real_generate, images_per_prompt = backend.generate, []

    def counted_generate(*args, multimodal=None, **kwargs):
        images_per_prompt.extend(0 if m is None else len(m.images) for m in multimodal or [])
        return real_generate(*args, multimodal=multimodal, **kwargs)

    backend.generate = counted_generate
    if agents:
        call = {
            "tools": ("multiply", {"a": 6, "b": 7}),
            "environment": ("increment", {"step": 2}),
            "tool_images": ("look", {}),
        }[variant]
        text = "<tool_call>" + json.dumps({"name": call[0], "arguments": call[1]}) + "</tool_call><|im_end|>"
        call_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        trainer.run.rollouts.backend = FirstTurnCallsTheTool(backend, tokenizer, call_ids)
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
                "tool_calls": [e.get("tools/call_frequency") for e in history if "loss" in e],
                "continuations": getattr(trainer.run.rollouts.backend, "continuations", []),
                "image_gaps": image_gaps(trainer, real_sync, backend.llm, vllm) if images else None,
                "images_per_prompt": images_per_prompt,
                "tool_image_gaps": (
                    tool_image_gaps(trainer, real_sync, backend.llm, vllm, trainer.run.rollouts.backend.continued)
                    if variant == "tool_images"
                    else None
                ),
            },
            handle,
        )


if __name__ == "__main__":  # vLLM spawns its engine process
    main(*sys.argv[1:])
