"""Which features combine: one declared table, checked when the trainer is built.

Every pair of features is one of four kinds:

- works: built and exercised by a test (the cell names it);
- not built: refused at construction with an error that names both features and says what to do,
  instead of failing (or silently doing something else) in the middle of training;
- untested: allowed, no test covers the pair yet (docs/combinations.md lists them);
- exclusive: the two are settings of one choice (where a run samples), so no run has both.

The trainer works out which features a run uses (``trainer_parts.active_features``) and calls
``check_combinations``; docs/combinations.md is rendered from this table (``rewrite_doc``), and a test
keeps the two in step.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations as pairs
from typing import Iterable

# name -> how the user turns the feature on (used in error messages and the docs).
FEATURES: dict[str, str] = {
    "tools": "tools (GRPOTrainer argument)",
    "environment_factory": "environment_factory (GRPOTrainer argument)",
    "rollout_func": "rollout_func (GRPOTrainer argument)",
    "images": "image prompts (an image/images dataset column)",
    "in_process_sampling": "in-process sampling (generation_engine='auto', 'engine' or 'transformers')",
    "generation_server": "a generation server (generation_engine='server', or use_vllm=True with vllm_mode='server')",
    "vllm_colocate": "vLLM colocate (use_vllm=True, vllm_mode='colocate')",
    "gfpo": "GFPO (GFPOTrainer with num_remains_in_group)",
    "dynamic_sampling": "dynamic_sampling=True",
    "lora": "LoRA (peft_config, or a PeftModel as model)",
    "sync_ref_model": "sync_ref_model=True",
    "quantized": "a quantized policy (quantization_config, or a quantized model)",
    "sharded": "sharded weights (FSDP or DeepSpeed ZeRO-3 on several processes)",
    "async_generation": "asynchronous generation (async_generation=True, AsyncGRPOTrainer)",
    "lockstep_sampling": "sampling from the sharded policy itself (ds3_gather_for_generation=False, sharded weights)",
    "continuous_batching": "transformers continuous batching (use_transformers_continuous_batching=True)",
}

WORKS, NOT_BUILT, UNTESTED, EXCLUSIVE = "works", "not built", "untested", "exclusive"


@dataclass(frozen=True)
class Cell:
    status: str
    note: str  # works: the test that shows it; not built: why, and what to do instead


def _works(test: str) -> Cell:
    return Cell(WORKS, test)


def _not_built(note: str) -> Cell:
    return Cell(NOT_BUILT, note)


WHERE_SAMPLING_RUNS = (
    "both say where the completions are sampled, and a run samples in one place: in the training process, in a "
    "generation server (the asynchronous worker is one) or in colocated vLLM."
)


# Pairs not listed are UNTESTED. Keys are pairs of FEATURES names.
TABLE: dict[frozenset[str], Cell] = {
    frozenset(pair): cell
    for pair, cell in {
        # ---- agents ----
        ("tools", "environment_factory"): _works("tests/test_agents.py::test_cli_tools_and_environment_factory"),
        ("rollout_func", "tools"): _not_built(
            "rollout_func replaces generation entirely; call your tools inside rollout_func (marking their tokens with "
            "env_mask=0), or drop rollout_func."
        ),
        ("rollout_func", "environment_factory"): _not_built(
            "rollout_func replaces generation entirely; step your environment inside rollout_func, or drop "
            "rollout_func."
        ),
        ("tools", "in_process_sampling"): _works("tests/test_agents.py"),
        ("environment_factory", "in_process_sampling"): _works("tests/test_agents.py"),
        ("rollout_func", "in_process_sampling"): _works("tests/test_agents.py"),
        # ---- images (vision-language prompts) ----
        ("images", "tools"): _works(
            "tests/test_vlm_tools.py::test_a_tools_image_reaches_the_next_turn_and_training_as_the_processor_gives_it "
            "(every turn is sampled with the prompt's images, and with those the tools returned)"
        ),
        ("images", "environment_factory"): _works(
            "tests/test_vlm_tools.py::test_a_tools_image_reaches_the_next_turn_and_training_as_the_processor_gives_it "
            "(reset()'s observation joins the image prompt, which the processor encodes again)"
        ),
        ("images", "rollout_func"): _works(
            "tests/test_vlm.py::test_a_rollout_func_trains_image_prompts_with_their_images (prompt_ids as the "
            "processor expands them, or in placeholder form; others named)"
        ),
        ("images", "generation_server"): _works(
            "tests/test_server.py::test_image_prompts_sample_on_the_server_with_their_processor_outputs (`grouprl "
            "serve` is sent each prompt's processor outputs; vLLM's server is refused at the first generation)"
        ),
        ("images", "vllm_colocate"): _works(
            "tests/test_vllm_cpu.py::test_colocate_vllm_samples_image_prompts_with_their_images (Idefics3 on vLLM's "
            "CPU build: each prompt goes with its images and the chat template's placeholders, which vLLM expands)"
        ),
        ("images", "in_process_sampling"): _works(
            "tests/test_vlm.py (transformers generate; with generation_engine='captured', text-only calls take the "
            "captured loop: test_the_captured_loop_samples_text_prompts_and_generate_those_with_images)"
        ),
        ("images", "lora"): _works("tests/test_vlm.py (peft_config on the language model)"),
        ("images", "quantized"): _works(
            "tests/test_vlm.py::test_llava_from_a_path_trains_a_lora_adapter_on_the_language_model[qlora]"
        ),
        # ---- generation ----
        ("sharded", "in_process_sampling"): _works(
            "tests/test_distributed.py::test_sharded_policy_samples_from_a_replica_of_its_gathered_weights (FSDP2 "
            "and ZeRO-3, each with LoRA too; each "
            "process samples from an unsharded replica, its weights gathered before each generation)"
        ),
        ("sharded", "generation_server"): _works(
            "tests/test_distributed.py::test_sharded_policy_trains_against_a_generation_server (FSDP2 and ZeRO-3 on 2 "
            "processes beside grouprl serve: each weight sync gathers the shards, the main process sends them)"
        ),
        ("quantized", "generation_server"): _works(
            "tests/test_server.py::test_training_through_the_server_keeps_its_weights_in_sync[http-qlora] (the "
            "server gets the base dequantized with the adapters' update added: generation/weights.py)"
        ),
        ("sharded", "vllm_colocate"): _works(
            "tests/test_vllm_cpu.py::test_colocate_on_two_processes_each_with_its_engine (FSDP2 on 2 processes, one "
            "vLLM engine each, fed the gathered weights at every sync)"
        ),
        ("lora", "vllm_colocate"): _works(
            "tests/test_vllm_cpu.py::test_colocate_trains_and_vllm_serves_the_synced_weights (the merged weights)"
        ),
        ("quantized", "vllm_colocate"): _works(
            "tests/test_vllm_cpu.py::test_colocate_trains_and_vllm_serves_the_synced_weights[qlora] (vLLM serves the "
            "base dequantized with the adapters' update added)"
        ),
        ("quantized", "in_process_sampling"): _works("tests/test_qlora.py"),
        # ---- algorithm variants ----
        ("gfpo", "dynamic_sampling"): _not_built(
            "GFPO's filter keeps num_remains_in_group completions per group before dynamic sampling looks for tied "
            "groups of num_generations rows, so groups would be cut wrongly; use one of the two "
            "(dynamic_sampling=False, or GRPOTrainer)."
        ),
        ("gfpo", "tools"): _not_built("GFPOTrainer takes no tools argument; use GRPOTrainer for tool calling."),
        ("gfpo", "environment_factory"): _not_built(
            "GFPOTrainer takes no environment_factory argument; use GRPOTrainer for environments."
        ),
        ("gfpo", "rollout_func"): _not_built(
            "GFPOTrainer takes no rollout_func argument; use GRPOTrainer with rollout_func."
        ),
        ("gfpo", "in_process_sampling"): _works("tests/test_gfpo.py"),
        ("dynamic_sampling", "in_process_sampling"): _works(
            "tests/test_objectives_e2e.py::test_dynamic_sampling_trains_only_on_groups_with_signal"
        ),
        **{
            (variant, "sharded"): _works(
                f"tests/test_distributed.py::test_sharded_two_processes_train_like_one[{{fsdp2,zero3}}_{scenario}] "
                f"(2 processes give the weights of 1{note})"
            )
            for variant, scenario, note in (
                ("dynamic_sampling", "dynamic", ""),
                ("gfpo", "gfpo", ""),
                ("sync_ref_model", "sync_ref", "; also resumed from a checkpoint, which keeps the mixed reference"),
            )
        },
        ("sharded", "async_generation"): _works(
            "tests/test_async_resume.py::test_sharded_policy_feeds_its_async_worker (FSDP2 and ZeRO-3 on 2 processes: "
            "the local worker starts from, and is sent, the weights that every process gathers)"
        ),
        # ---- where sampling runs: one place per run ----
        **{
            pair: Cell(EXCLUSIVE, WHERE_SAMPLING_RUNS)
            for pair in (
                ("in_process_sampling", "generation_server"),
                ("in_process_sampling", "vllm_colocate"),
                ("in_process_sampling", "async_generation"),
                ("generation_server", "vllm_colocate"),
            )
        },
        # ---- agents with the other features ----
        **{
            (agent, "dynamic_sampling"): _works(
                "tests/test_agents.py::test_multi_turn_rows_survive_dynamic_sampling_with_each_kind_of_policy (the "
                "kept groups' rows trained on token for token, tool output out of the loss)"
            )
            for agent in ("tools", "environment_factory", "rollout_func")
        },
        **{
            (agent, other): _works(
                "tests/test_agents.py::test_multi_turn_rows_survive_dynamic_sampling_with_each_kind_of_policy"
            )
            for agent in ("tools", "environment_factory", "rollout_func")
            for other in ("lora", "quantized", "sync_ref_model")
        },
        **{
            (agent, "generation_server"): _works(
                "tests/test_server.py::test_tool_calls_continue_on_the_server_from_the_trainers_weights"
            )
            for agent in ("tools", "environment_factory")
        },
        ("rollout_func", "generation_server"): _works(
            "tests/test_server.py::test_rollout_func_samples_from_the_server_after_its_weight_sync (weights synced "
            "before rollout_func, as TRL does)"
        ),
        **{
            ("images", other): _works(
                "tests/test_vlm.py::test_every_trained_row_keeps_its_prompts_images_with_gfpo_dynamic_sampling_or_a_"
                "synced_reference"
            )
            for other in ("gfpo", "dynamic_sampling", "sync_ref_model")
        },
        ("quantized", "sharded"): _works(
            "tests/test_distributed.py::test_sharded_two_processes_train_like_one[{fsdp2,zero3}_qlora] (FSDP-QLoRA "
            "and ZeRO-3 QLoRA on 2 processes: the 1-process adapters, resumed exactly from a checkpoint); in-process "
            "sampling then needs ds3_gather_for_generation=False (an unsharded replica of a 4-bit policy is refused "
            "by name)"
        ),
        ("quantized", "lockstep_sampling"): _works(
            "tests/test_distributed.py::test_sharded_policy_samples_in_lockstep_without_gathering_its_weights "
            "({fsdp2,zero3}_lockstep_qlora)"
        ),
        **{
            (variant, "lockstep_sampling"): _works(
                "tests/test_distributed.py::test_the_algorithm_variants_sample_in_lockstep (FSDP2 and ZeRO-3 on 2 "
                "processes; dynamic sampling's second round in step)"
            )
            for variant in ("gfpo", "dynamic_sampling", "sync_ref_model")
        },
        **{
            (other, "vllm_colocate"): _works(
                "tests/test_vllm_cpu.py::test_colocate_trains_and_vllm_serves_the_synced_weights (vLLM's CPU build: "
                "its logprobs of a fixed sequence follow the trainer's at every sync)"
            )
            for other in ("gfpo", "dynamic_sampling", "sync_ref_model", "rollout_func")
        },
        **{
            (agent, "vllm_colocate"): _works(
                "tests/test_vllm_cpu.py::test_colocate_vllm_samples_the_turns_after_a_tool_result (vLLM's CPU build "
                "samples the turn after the tool's result from the synced weights; the importance-sampling correction "
                "holds across both turns)"
            )
            for agent in ("tools", "environment_factory")
        },
        ("rollout_func", "sharded"): _works(
            "tests/test_distributed.py::test_sharded_policy_samples_from_a_replica_of_its_gathered_weights "
            "({fsdp2,zero3}_sampled_rollout_func: trainer.generation_backend is each process's replica sampler)"
        ),
        **{
            (agent, "sharded"): _works(
                "tests/test_distributed.py::test_sharded_tool_calling_rollouts_train_like_one_process (FSDP2 and "
                "ZeRO-3 on 2 processes, the tool-calling group cut by the process boundary: the 1-process run's "
                "completions, tool masks and weights)"
            )
            for agent in ("tools", "environment_factory")
        },
        ("images", "sharded"): _works(
            "tests/test_distributed.py::test_sharded_image_prompts_train_like_one_process (FSDP2 and ZeRO-3 on 2 "
            "processes, one of them without images: its forwards run the vision tower on a probe image, "
            "model/multimodal.py)"
        ),
        ("sharded", "continuous_batching"): _works(
            "tests/test_distributed.py::test_sharded_policy_samples_from_a_replica_of_its_gathered_weights "
            "({fsdp2,zero3}_sampled_cb: generate_batch on each process's replica)"
        ),
        # ---- GFPO and dynamic sampling with the other features ----
        **{
            ("gfpo", other): _works(
                "tests/test_gfpo.py::test_gfpo_keeps_the_shortest_rows_with_lora_quantization_or_a_synced_reference"
            )
            for other in ("lora", "quantized", "sync_ref_model")
        },
        **{
            ("generation_server", other): _works(
                "tests/test_server.py::test_server_samples_from_the_trainers_weights_with_gfpo_dynamic_sampling_or_a_"
                "synced_reference"
            )
            for other in ("gfpo", "dynamic_sampling", "sync_ref_model")
        },
        **{
            ("dynamic_sampling", other): _works(
                "tests/test_agents.py::test_multi_turn_rows_survive_dynamic_sampling_with_each_kind_of_policy"
            )
            for other in ("lora", "quantized")
        },
        ("dynamic_sampling", "sync_ref_model"): _works(
            "tests/test_objectives_e2e.py::test_sync_ref_model_mixes_the_policy_into_the_reference[True]"
        ),
        # ---- LoRA and the reference model ----
        ("sync_ref_model", "quantized"): _not_built(
            "a quantized policy trains LoRA adapters, and with LoRA the reference is the frozen base model "
            "(adapters off), which syncing would overwrite; use sync_ref_model=False."
        ),
        ("generation_server", "lora"): _works(
            "tests/test_server.py::test_training_through_the_server_keeps_its_weights_in_sync (the adapters merged "
            "into the weights sent)"
        ),
        ("sync_ref_model", "lora"): _not_built(
            "with LoRA the reference is the frozen base model (adapters off), which syncing would overwrite; use "
            "sync_ref_model=False."
        ),
        ("lora", "quantized"): _works("tests/test_qlora.py (QLoRA)"),
        ("lora", "sharded"): _works(
            "tests/test_distributed.py::test_sharded_policy_samples_from_a_replica_of_its_gathered_weights"
            " (fsdp2_sampled_lora, zero3_sampled_lora)"
        ),
        ("lora", "in_process_sampling"): _works("tests/test_objectives_e2e.py"),
        ("sync_ref_model", "in_process_sampling"): _works(
            "tests/test_objectives_e2e.py::test_sync_ref_model_mixes_the_policy_into_the_reference"
        ),
        # ---- sampling from the sharded policy, every process in step (ds3_gather_for_generation=False) ----
        **{
            (agent, "lockstep_sampling"): _not_built(
                "each process takes as many generation turns as its own rows need, and every forward of the sharded "
                "model needs all the processes; leave ds3_gather_for_generation=True (each process then samples "
                "from a replica of the gathered weights)."
            )
            for agent in ("tools", "environment_factory", "rollout_func")
        },
        ("images", "lockstep_sampling"): _not_built(
            "a forward with images runs the vision tower, whose sharded weights a process without images would not "
            "gather with the others; leave ds3_gather_for_generation=True."
        ),
        **{
            (engine, "lockstep_sampling"): _not_built(
                "the server or vLLM keeps a whole copy of the weights of its own, so there is nothing to leave "
                "ungathered (TRL: not compatible with vLLM); leave ds3_gather_for_generation=True."
            )
            for engine in ("generation_server", "vllm_colocate", "async_generation")
        },
        ("sharded", "lockstep_sampling"): _works(
            "tests/test_distributed.py::test_sharded_policy_samples_in_lockstep_without_gathering_its_weights (FSDP2 "
            "and ZeRO-3 on 2 processes, whose rows finish at different steps)"
        ),
        ("in_process_sampling", "lockstep_sampling"): _works(
            "tests/test_distributed.py::test_sharded_policy_samples_in_lockstep_without_gathering_its_weights"
        ),
        ("lora", "lockstep_sampling"): _works(
            "tests/test_distributed.py::test_sharded_policy_samples_in_lockstep_without_gathering_its_weights (the "
            "adapters applied in the sharded forward)"
        ),
        # ---- transformers continuous batching (use_transformers_continuous_batching) ----
        **{
            (engine, "continuous_batching"): _not_built(
                "continuous batching samples in the training process, while this run samples elsewhere (TRL lets "
                "vLLM win silently); set use_transformers_continuous_batching=False."
            )
            for engine in ("generation_server", "vllm_colocate", "async_generation")
        },
        ("images", "continuous_batching"): _not_built(
            "transformers' generate_batch takes token ids only, not images; set use_transformers_continuous_batching"
            "=False."
        ),
        ("lockstep_sampling", "continuous_batching"): _not_built(
            "continuous batching runs its forwards on a thread of its own, never in step with the other processes; "
            "leave ds3_gather_for_generation=True (continuous batching then samples from each process's replica)."
        ),
        **{
            (other, "continuous_batching"): _works(
                "tests/test_continuous_batching.py::test_continuous_batching_samples_for_the_other_features"
            )
            for other in ("gfpo", "dynamic_sampling", "sync_ref_model", "quantized", "rollout_func")
        },
        **{
            (agent, "continuous_batching"): _works(
                "tests/test_agents.py::test_real_backend_continues_after_tool_results (the turns after a tool's "
                "result sampled by generate_batch)"
            )
            for agent in ("tools", "environment_factory")
        },
        ("in_process_sampling", "continuous_batching"): _works(
            "tests/test_continuous_batching.py::test_a_run_with_continuous_batching_learns"
        ),
        ("lora", "continuous_batching"): _works(
            "tests/test_continuous_batching.py::test_a_lora_policy_samples_with_its_adapter"
        ),
        # ---- asynchronous generation (its worker is a generation server: the generation_server rows apply) ----
        ("vllm_colocate", "async_generation"): _not_built(
            "asynchronous generation samples in a worker process of its own, while colocated vLLM lives in the "
            "training process; use vllm_mode='server' (or the local `grouprl serve` worker: use_vllm=False)."
        ),
        ("images", "async_generation"): _works(
            "tests/test_async_features.py::test_image_prompts_sample_on_the_worker_with_their_processor_outputs"
        ),
        ("quantized", "async_generation"): _works(
            "tests/test_async_features.py::test_lora_merged_weights_reach_the_worker[qlora] (the worker gets the base "
            "dequantized with the adapters' update added)"
        ),
        ("generation_server", "async_generation"): _works("tests/test_async.py"),
        ("tools", "async_generation"): _works("tests/test_async_features.py::test_tools_run_in_async_rollouts"),
        ("environment_factory", "async_generation"): _works(
            "tests/test_async_features.py::test_environments_in_async_rollouts (fresh instances per rollout)"
        ),
        ("rollout_func", "async_generation"): _works(
            "tests/test_async_features.py::test_rollout_func_samples_on_the_worker"
        ),
        ("gfpo", "async_generation"): _works("tests/test_async_features.py::test_gfpo_in_async_mode"),
        ("dynamic_sampling", "async_generation"): _works(
            "tests/test_async_features.py::test_dynamic_sampling_in_async_mode"
        ),
        ("lora", "async_generation"): _works(
            "tests/test_async_features.py::test_lora_merged_weights_reach_the_worker (merged weights are sent)"
        ),
        ("sync_ref_model", "async_generation"): _works(
            "tests/test_async_features.py::test_sync_ref_model_in_async_mode"
        ),
    }.items()
}


def cell(a: str, b: str) -> Cell:
    """What the table says about features `a` and `b` (UNTESTED when it says nothing)."""
    for name in (a, b):
        if name not in FEATURES:
            raise KeyError(f"{name!r} is not a feature of the combination table; known: {', '.join(FEATURES)}.")
    return TABLE.get(frozenset((a, b)), Cell(UNTESTED, ""))


class UnsupportedCombination(NotImplementedError, ValueError):
    """Two features that are each built but not together. Both a NotImplementedError (the pair is not built) and a
    ValueError (the arguments as given cannot run), as the checks it replaces raised one or the other."""


def check_combinations(active: Iterable[str]) -> None:
    """Raise UnsupportedCombination for the first pair of `active` features the table marks not built."""
    names = [
        name for name in FEATURES if name in set(active)
    ]  # table order: the same pair is reported first every time
    for a, b in pairs(names, 2):
        found = cell(a, b)
        if found.status == NOT_BUILT:
            raise UnsupportedCombination(
                f"{FEATURES[a]} cannot be combined with {FEATURES[b]} in this version of grouprl: {found.note}"
            )


TABLE_BEGIN = (
    '<!-- combinations:begin (generated: python -c "from grouprl.config.combinations import rewrite_doc; '
    'rewrite_doc()") -->'
)
TABLE_END = "<!-- combinations:end -->"


def combinations_markdown() -> str:
    """The table as markdown: every declared pair, then the features with what turns them on."""
    lines = ["| feature | with | status | note |", "|---|---|---|---|"]
    for a, b in pairs(FEATURES, 2):
        found = cell(a, b)
        if found.status != UNTESTED:
            lines.append(f"| `{a}` | `{b}` | {found.status} | {found.note.replace('|', '/')} |")
    lines += [
        "",
        "Pairs not listed are untested: allowed, with no test covering them yet.",
        "",
        "| feature | turned on by |",
        "|---|---|",
    ]
    lines += [f"| `{name}` | {how.replace('|', '/')} |" for name, how in FEATURES.items()]
    return "\n".join(lines)


def rewrite_doc(path: str = "docs/combinations.md") -> bool:
    """Replace the generated part of `path` between the markers; True if it changed."""
    text = open(path, encoding="utf-8").read()
    head, _, rest = text.partition(TABLE_BEGIN)
    _, _, tail = rest.partition(TABLE_END)
    updated = f"{head}{TABLE_BEGIN}\n{combinations_markdown()}\n{TABLE_END}{tail}"
    if updated != text:
        open(path, "w", encoding="utf-8").write(updated)
    return updated != text
