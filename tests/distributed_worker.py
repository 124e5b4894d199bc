r"""Training runs that the multi-process tests launch on 2 CPU processes (gloo) and run on 1 for reference.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests/distributed_worker.py OUT_DIR MODEL_DIR SCENARIO...

Every scenario trains 2 optimizer steps on completions that a deterministic backend derives from
(prompt, index of the sample in its group), so 1 and 2 processes train on exactly the same
completions; the `*_sampled*` ones sample in the processes instead (a sharded policy's replica) and record each
weight sync. The global batch of one generation is 3 prompts x 4 samples: with 2 processes the
middle group straddles them (process 0 samples 2 of its completions, process 1 the other 2).
Each process writes what it saw (advantages, completions, group ids) and the main process the
final weights and logged metrics to OUT_DIR/<scenario>-<processes>p-rank<r>.pt. At exit each process writes
whether the process group is still initialized and which gloo threads are left to OUT_DIR/exit-rank<r>.json.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import importlib.util
import json
import os
import sys
from unittest import mock

import datasets
import peft
import torch
import vlm_models
from accelerate import PartialState
from helpers import Counter, gloo_threads, look, multiply, sample_through_the_backend
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from grouprl import GFPOConfig, GFPOTrainer, GRPOConfig, GRPOTrainer
from grouprl.core.types import Completion
from grouprl.generation.factory import ShardedPolicySampler
from grouprl.generation.hf import TransformersGenerator
from grouprl.generation.weights import inference_weights, load_weights, materialize, replica_of
from grouprl.model import quantization as quantization_module
from grouprl.model.full_state import gathered, whole

NUM_GENERATIONS = 4
# scenario -> (loss_type, main process samples for everyone (server-style dispatch;
# None: the config's backend), extra config)
SCENARIOS = {
    "dapo": ("dapo", False, {}),
    "grpo": ("grpo", False, {}),
    "grpo_main": ("grpo", True, {}),
    # the entropy threshold is taken per micro-batch over all processes: one micro-batch per
    # generation, so that 1 and 2 processes see the same tokens
    "dapo_entropy": ("dapo", True, {"top_entropy_quantile": 0.5, "gradient_accumulation_steps": 1}),
    # one generation feeds 2 optimizer steps; a checkpoint after the first holds every process's
    # second micro-batch and RNG state
    "dapo_resume": ("dapo", False, {"gradient_accumulation_steps": 1, "steps_per_generation": 2, "resume": True}),
    # a real `grouprl serve` (url in $GROUPRL_TEST_SERVER): only the main process talks to it; a fixed
    # request seed makes its samples the same for 1 and 2 processes
    "grpo_server": ("grpo", None, {"generation_engine": "server", "generation_kwargs": {"seed": 0}}),
    # DAPO dynamic sampling: the groups of prompts with an even token sum tie and are dropped; the
    # kept rows are dealt out again over the processes
    "dapo_dynamic": ("dapo", False, {"dynamic_sampling": True, "max_dynamic_sampling_rounds": 2}),
    # GFPO keeping the first 2 samples of each group: with 2 processes process 0 keeps 4 rows (group 0's and both kept
    # rows of the cut group 1) and process 1 keeps 2, so the kept rows are gathered and dealt out again, 3 each
    "gfpo": ("grpo", False, {"num_remains_in_group": 2, "gradient_accumulation_steps": 1}),
    # image prompts (a tiny Qwen2-VL) under DDP: in each generation only the first prompt has an image, so process 1's
    # rows have none (the logs gather the images column on both processes all the same)
    "grpo_images": ("grpo", False, {"beta": 0.1, "images": True, "shuffle_dataset": False}),
    # sampled by `grouprl serve` of the tiny Qwen2-VL ($GROUPRL_TEST_VLM_SERVER), the image on each generation's last
    # prompt, so on process 1's rows: the main process sends every group's prompt with its processor outputs, gathered
    "grpo_images_server": (
        "grpo",
        None,
        {
            "beta": 0.1,
            "images": True,
            "image_group": 2,
            "shuffle_dataset": False,
            "generation_engine": "server",
            "generation_kwargs": {"seed": 0},
        },
    ),
    # image prompts (the first of each generation's 3) and a tool that returns an image (`look`), called by the first
    # turn of every even sample: the turn after it and the training forward get the prompt's images and the tool's
    "grpo_tool_images": (
        "grpo",
        False,
        {"beta": 0.1, "images": True, "agent": "tools", "tool": "look", "max_completion_length": 160},
    ),
    # launched with the bundled fsdp2 config (the weights sharded over the processes); with a reference model
    "fsdp2": ("grpo", False, {"beta": 0.1}),
    # sampled in the training processes (generation_engine='auto'): under sharding, from an unsharded replica
    "fsdp2_sampled": ("grpo", None, {"beta": 0.1}),
    # the same with LoRA adapters (the replica takes the merged weights; the config's optimizer, built on the adapters;
    # under ZeRO-3 each adapter's update is added to its gathered base weight, which PEFT's merge cannot do)
    "fsdp2_sampled_lora": ("grpo", None, {"beta": 0.1, "lora": True}),
    # QLoRA: the 4-bit policy with LoRA adapters (FSDP-QLoRA)
    "fsdp2_qlora": ("grpo", False, {"beta": 0.1, "lora": True, "quantized": True, "resume": True}),
    # a rollout_func sampling through trainer.generation_backend (the replica sampler)
    "fsdp2_sampled_rollout_func": ("grpo", None, {"beta": 0.1, "rollout_func": True}),
    # the same with transformers continuous batching sampling from the replica
    "fsdp2_sampled_cb": ("grpo", None, {"beta": 0.1, "use_transformers_continuous_batching": True}),
    # sampled from the sharded policy itself, the processes in step (ds3_gather_for_generation=False); each also
    # with LoRA (the adapters applied in the sharded forward)
    "fsdp2_lockstep": ("grpo", None, {"beta": 0.1, "ds3_gather_for_generation": False}),
    "fsdp2_lockstep_lora": ("grpo", None, {"beta": 0.1, "lora": True, "ds3_gather_for_generation": False}),
    "fsdp2_lockstep_qlora": (
        "grpo",
        None,
        {"beta": 0.1, "lora": True, "quantized": True, "ds3_gather_for_generation": False},
    ),
    # sampled by a real `grouprl serve` (TRL's everyday multi-GPU setup: vLLM's server beside a sharded policy): each
    # weight sync gathers the shards on every process and the main process alone sends them
    "fsdp2_server": ("grpo", None, {"beta": 0.1, "generation_engine": "server", "generation_kwargs": {"seed": 0}}),
    # multi-turn rollouts: the first turn of every other sample calls a tool (TRL's tools / environment_factory),
    # the turn after the tool's result follows the conversation so far; the tool results stay out of the loss
    "fsdp2_tools": ("grpo", False, {"beta": 0.1, "agent": "tools", "max_completion_length": 160}),
    "fsdp2_environment": ("grpo", False, {"beta": 0.1, "agent": "environment_factory", "max_completion_length": 160}),
    # image prompts (a tiny Qwen2-VL): in each generation only the first prompt has an image, so process 1's rows have
    # none while process 0's have: under sharding process 1's forwards run the vision tower on a probe image
    "fsdp2_images": ("grpo", False, {"beta": 0.1, "images": True, "shuffle_dataset": False}),
    # AdamW's state in the checkpoint; the final model saved with save_model
    "fsdp2_resume": (
        "dapo",
        False,
        {"gradient_accumulation_steps": 1, "steps_per_generation": 2, "resume": True, "optimizer": "adamw"},
    ),
}
VARIANTS = ("_dynamic", "_gfpo", "_sync_ref", "_qlora")
# the algorithm variants under sharding: DAPO's dynamic sampling, GFPO's filter, TR-DPO's reference syncing (the
# policy mixed into the reference after every step; the reference is whole on each process under FSDP2 and sharded in
# an inference engine of its own under ZeRO-3), resumed from the step-1 checkpoint, which holds the mixed reference
SCENARIOS.update(
    fsdp2_dynamic=SCENARIOS["dapo_dynamic"],
    fsdp2_gfpo=SCENARIOS["gfpo"],
    fsdp2_sync_ref=(
        "grpo",
        False,
        {"beta": 0.1, "sync_ref_model": True, "ref_model_sync_steps": 1, "ref_model_mixup_alpha": 0.5, "resume": True},
    ),
)
# the same variants sampled in step from the sharded policy (ds3_gather_for_generation=False): dynamic sampling's
# extra rounds and GFPO's filter must keep the processes' forwards in step
SCENARIOS.update(
    {
        f"fsdp2_lockstep{variant}": (
            SCENARIOS[f"fsdp2{variant}"][0],
            None,
            {
                **SCENARIOS[f"fsdp2{variant}"][2],
                "ds3_gather_for_generation": False,
                "resume": False,
                "odd_prompts_tie": variant == "_dynamic",
            },
        )
        for variant in VARIANTS[:3]
    }
)
# the scenarios launched with a sharding config (zero2 / zero3: DeepSpeed's CPU accelerator over gloo), by config
# (ZeRO-2 shards the optimizer's state only: its processes sample from the policy itself, as DDP's)
# (the `*_server` ones only where grouprl serve's libraries are installed)
HAS_SERVER_LIBRARIES = all(importlib.util.find_spec(name) is not None for name in ("fastapi", "uvicorn"))
SERVED = ("_server",) if HAS_SERVER_LIBRARIES else ()
SAMPLED_KINDS = ("_sampled", "_sampled_lora", "_sampled_cb", "_sampled_rollout_func")
LOCKSTEP_KINDS = (
    "_lockstep",
    "_lockstep_lora",
    "_lockstep_qlora",
    "_lockstep_dynamic",
    "_lockstep_gfpo",
    "_lockstep_sync_ref",
)
AGENT_KINDS = ("_tools", "_environment")
SHARDED_KINDS = ("", "_resume") + SAMPLED_KINDS + LOCKSTEP_KINDS + VARIANTS + AGENT_KINDS + ("_images",) + SERVED
SHARDED = {
    "fsdp2": tuple(f"fsdp2{kind}" for kind in SHARDED_KINDS),
    "zero2": ("zero2", "zero2_resume"),
    "zero3": tuple(f"zero3{kind}" for kind in SHARDED_KINDS),
}
for _config, _names in SHARDED.items():
    for _name in _names:
        SCENARIOS.setdefault(_name, SCENARIOS[_name.replace(_config, "fsdp2", 1)])


def first_two(group_completions, group_rewards, **kwargs):
    """A GFPO filter that keeps samples 0 and 1 of every group (the highest scores)."""
    return [[-float(i) for i in range(len(group))] for group in group_completions]


class GroupScript:
    """Completions decided by (prompt ids, index of the sample within its whole group).

    A process that samples only the tail of a group cut by the process boundary (process > 0,
    fewer than G samples for its first prompt) continues the group's numbering, so the group's G
    completions are the same however the batch is split. With `main_process_only` the grouprl
    dispatcher asks for whole groups on the main process instead.
    """

    needs_importance_correction = False
    end_of_turn = None  # ToolScript's turns end with the chat template's end-of-turn token

    def __init__(self, tokenizer, main_process_only: bool, ties: bool = False):
        self.tokenizer, self.eos = tokenizer, tokenizer.eos_token_id
        self.main_process_only, self.ties = main_process_only, ties

    def sync_weights(self, model):
        pass

    def generate(self, prompt_ids, num_samples, params, multimodal=None):
        offset = (
            NUM_GENERATIONS - num_samples if PartialState().process_index > 0 and num_samples < NUM_GENERATIONS else 0
        )
        out = []
        for p, ids in enumerate(prompt_ids):
            for s in range(offset, offset + num_samples):
                s = 0 if self.ties and sum(ids) % 2 == 0 else s  # every sample alike: the group's rewards tie
                tokens = self.tokens(ids, s)[: params.max_new_tokens]
                finish = "stop" if tokens[-1] in (self.eos, self.end_of_turn) else "length"
                out.append(Completion(p, tokens, self.tokenizer.decode(tokens, skip_special_tokens=True), finish))
        return out

    def tokens(self, ids: list[int], s: int) -> list[int]:
        body = [(ids[-1] + 7 * s + k) % 200 + 3 for k in range(1 + (s * 3 + len(ids)) % 6)]
        return body + ([self.eos] if s % 3 else [])


class ToolScript(GroupScript):
    """GroupScript for multi-turn rollouts: the first turn of every even sample calls `tool` (its argument follows the
    prompt and the sample), and a turn after a tool's result follows the conversation so far, whatever process or
    call it falls to."""

    def __init__(self, tokenizer, tool: str):
        super().__init__(tokenizer, main_process_only=False)
        self.tool, self.end_of_turn = tool, tokenizer.convert_tokens_to_ids("<|im_end|>")

    def text(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.end_of_turn]

    def tokens(self, ids: list[int], s: int) -> list[int]:
        if "<tool_response>" in self.tokenizer.decode(ids):  # the turn after the result
            return self.text(f"It is {sum(ids) % 97}.")
        if s % 2:
            return super().tokens(ids, s)
        argument = {
            "multiply": {"a": ids[-1] % 9, "b": s},
            "increment": {"step": 1 + (ids[-1] + s) % 4},
            "look": {"index": ids[-1] + s},
        }[self.tool]
        return self.text("<tool_call>" + json.dumps({"name": self.tool, "arguments": argument}) + "</tool_call>")


def distinct_tokens(completion_ids, **kwargs):
    return [float(len(set(ids)) + sum(ids) % 5) for ids in completion_ids]


def odd_prompts_tie(prompts, completion_ids, **kwargs):
    """distinct_tokens, but every completion of an odd-numbered prompt scores 1: dynamic sampling drops those groups
    and draws again."""
    scores = distinct_tokens(completion_ids)
    return [1.0 if int(prompt.split("+")[0]) % 2 else score for prompt, score in zip(prompts, scores)]


def run(scenario: str, out_dir: str, model_dir: str) -> dict:
    loss_type, main_only, extra = SCENARIOS[scenario]
    extra = dict(extra)
    resume = extra.pop("resume", False)
    adamw = extra.pop("optimizer", None) == "adamw"
    lora = extra.pop("lora", False)
    quantized = extra.pop("quantized", False)
    ties = extra.pop("odd_prompts_tie", False)
    custom_rollouts = extra.pop("rollout_func", False)
    agent = extra.pop("agent", None)
    tool = extra.pop("tool", "multiply")
    images = extra.pop("images", False)
    image_group = extra.pop("image_group", 0)  # which of each generation's 3 prompts has an image
    if agent and not images:  # room for the tools' schemas, a template that renders them (conftest's tool model)
        model_dir = os.environ["GROUPRL_TEST_TOOL_MODEL"]
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    accumulation = extra.pop("gradient_accumulation_steps", 2)
    micro_steps = extra.get("steps_per_generation") or accumulation
    if extra.get("generation_engine") == "server":
        extra["vllm_server_base_url"] = os.environ["GROUPRL_TEST_VLM_SERVER" if images else "GROUPRL_TEST_SERVER"]
    gfpo = "num_remains_in_group" in extra
    config = (GFPOConfig if gfpo else GRPOConfig)(
        output_dir=os.path.join(out_dir, f"{scenario}-{processes}p"),
        per_device_train_batch_size=12 // (processes * micro_steps),
        gradient_accumulation_steps=accumulation,
        num_generations=NUM_GENERATIONS,
        max_completion_length=extra.pop("max_completion_length", 8),
        learning_rate=0.5,
        max_steps=2,
        logging_steps=1,
        save_strategy="steps" if resume else "no",
        save_steps=1,
        report_to="none",
        disable_tqdm=True,
        seed=0,
        bf16=False,
        gradient_checkpointing=False,
        max_grad_norm=0,
        lr_scheduler_type="constant",
        loss_type=loss_type,
        **extra,
    )
    prompts = [f"{i}+{i % 5}=" for i in range(12)]
    if agent or images:
        prompts = [[{"role": "user", "content": prompt}] for prompt in prompts]
    columns = {"prompt": prompts}
    if images:
        columns["images"] = [[vlm_models.image(i)] if i % 3 == image_group else [] for i in range(12)]
        processor = vlm_models.tiny_qwen2_vl(model_from=os.environ["GROUPRL_TEST_VLM_MODEL"])[1]
        if agent:
            vlm_models.with_tool_template(processor)
        tokenizer = processor.tokenizer
    dataset = datasets.Dataset.from_dict(columns)
    seen = []

    def build() -> GRPOTrainer:
        quantization = {"quantization_config": BitsAndBytesConfig(load_in_4bit=True)} if quantized else {}
        model = (
            vlm_models.tiny_qwen2_vl(model_from=os.environ["GROUPRL_TEST_VLM_MODEL"])[0]
            if images
            else AutoModelForCausalLM.from_pretrained(model_dir, **quantization)
        )
        if images and agent:
            vlm_models.end_turns_at_im_end(model, tokenizer)
        # SGD: update = gradient, so a gradient bug shows; AdamW: its state must survive a checkpoint
        optimizer = (torch.optim.AdamW if adamw else torch.optim.SGD)(model.parameters(), lr=config.learning_rate)
        peft_config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]) if lora else None
        backend = None if main_only is None else GroupScript(tokenizer, main_only, config.dynamic_sampling)
        if agent:
            backend = ToolScript(tokenizer, tool if agent == "tools" else "increment")
        # Adapters kept in fp32 on every machine. As TRL, grouprl casts a 4-bit policy's adapters to bf16 where bf16
        # is native (GPUs, AVX512-BF16 CPUs); there AdamW's first step turns a gradient element that the 2-process
        # reduction rounds to the other side of zero into +-lr (1.77 apart at lr 0.5, measured): no sharding check.
        fp32_adapters = mock.patch.object(quantization_module, "cast_adapters_to_bf16", lambda model: None)
        with fp32_adapters if quantized else contextlib.nullcontext():
            trainer = (GFPOTrainer if gfpo else GRPOTrainer)(
                model=model,
                reward_funcs=odd_prompts_tie if ties else distinct_tokens,
                args=config,
                train_dataset=dataset,
                processing_class=processor if images else tokenizer,
                optimizers=(None, None) if lora else (optimizer, None),
                peft_config=peft_config,
                generation_backend=backend,
                **({"group_filter_func": first_two} if gfpo else {}),
                **({"rollout_func": sample_through_the_backend} if custom_rollouts else {}),
                **({"tools": [{"multiply": multiply, "look": look}[tool]]} if agent == "tools" else {}),
                **({"environment_factory": Counter} if agent == "environment_factory" else {}),
            )
        score = trainer.run.rollouts.score

        def recording_score(rollout, trainer_state, window):
            rollout, rewards, advantages = score(rollout, trainer_state, window)
            seen.append(
                {
                    "advantages": advantages.clone(),
                    "completions": [c.token_ids for c in rollout.completions],
                    "tool_masks": [c.tool_mask for c in rollout.completions],
                    # each row's images when its tools returned some (the prompt's, then the tool's)
                    "rollout_images": [0 if c.images is None else len(c.images.images) for c in rollout.completions],
                    "with_images": [
                        m is not None for m in rollout.prompts.multimodal or [None] * len(rollout.prompts.prompts)
                    ],
                    "group_ids": list(rollout.prompts.group_ids),
                    "num_samples": list(rollout.prompts.num_samples),
                }
            )
            return rollout, rewards, advantages

        trainer.run.rollouts.score = recording_score
        if isinstance(trainer.generation_backend, ShardedPolicySampler):
            record_replica(trainer)
        if getattr(trainer.generation_backend, "lockstep", False):
            record_lockstep(trainer)
        if extra.get("generation_engine") == "server":
            record_server(trainer)
        return trainer

    syncs = []

    def record_replica(trainer: GRPOTrainer) -> None:
        """After each weight sync, how far the replica's weights are from the policy's (gathered: both processes
        take part). Process 1 then samples once more on its own, which no other process follows: a collective in
        sampling would hang the run."""
        sampler = trainer.generation_backend
        sync = sampler.sync_weights

        def recording_sync(model):
            freed = sampler.replica is not None and all(p.is_meta for p in sampler.replica.parameters())
            sync(model)
            gathered = dict(inference_weights(model))
            replica = dict(sampler.replica.named_parameters())
            syncs.append(
                {
                    "freed_before": freed,  # the last generation's end released the replica's weights
                    "difference": max((replica[n] - t).abs().max().item() for n, t in gathered.items()),
                    "checksum": sum(t.double().sum().item() for t in gathered.values()),
                    "sharded": any(hasattr(p, "full_tensor") or hasattr(p, "ds_id") for p in model.parameters()),
                }
            )
            if PartialState().process_index == 1:
                ids = tokenizer("1+1=")["input_ids"]
                alone = sampler.generate([ids], 3, trainer.run.rollouts.sampling)
                syncs[-1]["sampled_alone"] = len(alone)

        sampler.sync_weights = recording_sync

    def record_lockstep(trainer: GRPOTrainer) -> None:
        """Process 1 samples at most 3 tokens a row against process 0's 8, so its rows are done 5 decode steps
        before process 0's: it must keep taking part in process 0's forwards. After each generation each process
        samples its rows again from the sharded policy and from an unsharded copy of its gathered weights, both
        seeded alike, and then once more with no rows on process 0."""
        rollouts, backend = trainer.run.rollouts, trainer.generation_backend
        if PartialState().process_index == 1:
            rollouts.sampling = dataclasses.replace(rollouts.sampling, max_new_tokens=3)
        generate = backend.generate

        def recording_generate(prompt_ids, num_samples, params, **kwargs):
            completions = generate(prompt_ids, num_samples, params, **kwargs)
            model = backend.model
            if quantized:  # no unsharded copy to compare with: gathering a 4-bit policy's weights is not built
                samples.append({"rows": len(prompt_ids) * num_samples, "num_samples": num_samples})
                samples[-1]["lengths"] = [len(c.token_ids) for c in completions]
                samples[-1]["sharded"] = any(
                    hasattr(p, "full_tensor") or hasattr(p, "ds_id") for p in model.parameters()
                )
                return completions
            reference = replica_of(model)  # built outside ZeRO-3's partitioning, as the replica sampler's
            with torch.no_grad():
                materialize(reference, model)
                load_weights(reference, model)  # gathered: both processes take part
            unsharded = TransformersGenerator(reference, tokenizer, backend.eos_token_ids, backend.pad_token_id)

            def seeded(backend_generate) -> list[list[int]]:
                with torch.random.fork_rng():
                    torch.manual_seed(len(samples))
                    return [c.token_ids for c in backend_generate(prompt_ids, num_samples, params)]

            process = PartialState().process_index
            samples.append(
                {
                    "rows": len(prompt_ids) * num_samples,
                    "num_samples": num_samples,
                    "lengths": [len(c.token_ids) for c in completions],
                    "sharded": any(hasattr(p, "full_tensor") or hasattr(p, "ds_id") for p in model.parameters()),
                    "checksum": sum(p.double().sum().item() for p in reference.parameters()),
                    "seeded": seeded(generate),
                    "unsharded_seeded": seeded(unsharded.generate),
                    "without_rows": len(generate([] if process == 0 else prompt_ids, num_samples, params)),
                }
            )
            return completions

        backend.generate = recording_generate

    samples = []

    def record_server(trainer: GRPOTrainer) -> None:
        """After each weight sync, the logprobs that the server and an unsharded copy of the policy's gathered
        weights give one fixed sequence (main process; both processes take part in the gathers)."""
        backend = trainer.generation_backend
        sync = backend.sync_weights
        ids = tokenizer("3+4=7")["input_ids"]

        def recording_sync(model):
            sync(model)
            reference = replica_of(model)
            with torch.no_grad():
                load_weights(reference, model)
                logits = reference(torch.tensor([ids])).logits[0, :-1].float()
            policy = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]
            if PartialState().is_main_process:
                server = torch.tensor(backend.score(ids))
                syncs.append({"server": server, "policy": policy})

        backend.sync_weights = recording_sync

    def weights(trainer: GRPOTrainer) -> dict:
        """The full parameters (FSDP2's and ZeRO-3's shards gathered: every process takes part), as an inference copy
        loads them."""
        model = trainer.accelerator.unwrap_model(trainer.run.model)
        if quantized:  # the trained part: the adapters (the 4-bit base is frozen)
            adapters = [(name, p) for name, p in model.named_parameters() if "lora_" in name]
            with gathered([p for _, p in adapters]):
                return {name: whole(p).clone() for name, p in adapters}
        return {name: tensor.clone() for name, tensor in inference_weights(model)}

    trainer = build()
    trainer.train()
    accelerator = trainer.accelerator
    result = {
        "seen": list(seen),
        "syncs": list(syncs),
        "samples": list(samples),
        "backend": type(trainer.generation_backend).__name__,
        "replica_sampler": type(getattr(trainer.generation_backend, "backend", None)).__name__,
        "processes": processes,
        "weights": weights(trainer),
        "log_history": trainer.state.log_history,
        "distributed_type": str(accelerator.distributed_type),
        "sharded": any(
            hasattr(p, "full_tensor") or hasattr(p, "ds_id")
            for p in accelerator.unwrap_model(trainer.run.model).parameters()
        ),
    }
    if (
        resume
    ):  # a second run that resumes from the step-1 checkpoint, with a micro-batch of generation 1 still buffered
        resumed = build()
        resumed.train(resume_from_checkpoint=os.path.join(config.output_dir, "checkpoint-1"))
        result["resumed_weights"] = weights(resumed)
        result["saved_model"] = os.path.join(config.output_dir, "saved")
        resumed.save_model(result["saved_model"])
    torch.save(result, os.path.join(out_dir, f"{scenario}-{processes}p-rank{accelerator.process_index}.pt"))
    return result


def record_gloo_threads_at_exit(out_dir: str) -> None:
    """Runs after grouprl's exit handler (atexit is last in, first out). Like TRL's scripts, this one never ends
    the process group itself: grouprl must have ended it and stopped gloo's threads before the interpreter goes."""
    state = {
        "group_initialized": torch.distributed.is_initialized(),
        "gloo_threads": gloo_threads(),
    }
    with open(os.path.join(out_dir, f"exit-rank{os.environ.get('RANK', '0')}.json"), "w", encoding="utf-8") as handle:
        json.dump(state, handle)


if __name__ == "__main__":
    out_dir, model_dir, *scenarios = sys.argv[1:]
    atexit.register(record_gloo_threads_at_exit, out_dir)
    for name in scenarios:
        run(name, out_dir, model_dir)
