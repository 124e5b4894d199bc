"""Multi-process training: 2 real CPU processes (accelerate launch, gloo) against 1 process.

The same completions are injected into both (tests/distributed_worker.py), the global batch has a
group straddling the two processes, and the optimizer is SGD (update = gradient), so any error in
the gathers, the advantage slices, the DAPO token denominator or the gradient averaging shows up
in the weights.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
import vlm_models
import yaml
from conftest import free_port
from distributed_worker import HAS_SERVER_LIBRARIES, SCENARIOS, SHARDED, VARIANTS, run
from helpers import max_difference, parameters
from transformers import AutoModelForCausalLM

from grouprl.launch import resolve_accelerate_config

WORKER = os.path.join(os.path.dirname(__file__), "distributed_worker.py")
LAUNCHED_SHARDED = {name for names in SHARDED.values() for name in names}
RUNNABLE = [
    name
    for name in SCENARIOS
    if (HAS_SERVER_LIBRARIES or not name.endswith("_server")) and name not in LAUNCHED_SHARDED
]


LAUNCH_ENV = {
    "OMP_NUM_THREADS": "1",
    "PYTHONPATH": os.pathsep.join(sys.path),
    "TOKENIZERS_PARALLELISM": "false",
    "PYTHONFAULTHANDLER": "1",  # a crash prints every thread's Python stack
}


def accelerate_launch(
    nproc: int, flags: list[str], args: list[str], config: str = "", python: str = sys.executable
) -> list[str]:
    """The command line users run: accelerate launch with grouprl's bundled multi_gpu config, or the `config` file
    given, under `python` (on a machine without GPUs the processes join over gloo)."""
    config = config or resolve_accelerate_config("multi_gpu")
    launcher = [python, "-m", "accelerate.commands.launch", "--config_file", config]
    return [*launcher, "--num_processes", str(nproc), *flags, *args]


def launch(nproc: int, args: list[str], timeout: float = 120, config: str = "") -> subprocess.CompletedProcess:
    """Run a script on `nproc` CPU processes of this machine, 1 thread each (DeepSpeed importable for a ZeRO
    config)."""
    flags = ["--main_process_port", str(free_port())] + (["--mixed_precision", "no"] if config else [])
    command = accelerate_launch(nproc, flags, args, config)
    env = {**os.environ, **LAUNCH_ENV}
    if "zero" in os.path.basename(config) and deepspeed_path():
        env["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], deepspeed_path()])
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(scope="module")
def monkeypatch_session():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def two_process_runs(tiny_model_dir, tmp_path_factory, monkeypatch_session, request):
    if HAS_SERVER_LIBRARIES:
        monkeypatch_session.setenv("GROUPRL_TEST_SERVER", request.getfixturevalue("grouprl_server")[0])
        monkeypatch_session.setenv("GROUPRL_TEST_VLM_SERVER", request.getfixturevalue("qwen2_vl_server")[0])
    monkeypatch_session.setenv("GROUPRL_TEST_VLM_MODEL", str(request.getfixturevalue("qwen2_vl_model_dir")))
    out = tmp_path_factory.mktemp("two_process")
    result = launch(2, [WORKER, str(out), str(tiny_model_dir), *RUNNABLE])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    runs = {
        name: [torch.load(out / f"{name}-2p-rank{r}.pt", weights_only=False) for r in range(2)] for name in RUNNABLE
    }
    runs["at_exit"] = [json.loads((out / f"exit-rank{r}.json").read_text()) for r in range(2)]
    return runs


@pytest.mark.e2e
def test_gloo_threads_are_stopped_at_exit(two_process_runs):
    """A script that never calls destroy_process_group (TRL's do not) must not leave gloo's threads to the
    interpreter's teardown, where they now and then abort a finished run with SIGABRT. Ending the group is not
    enough: its threads live on while a trainer's DDP wrapper holds it (each process builds one per scenario)."""
    assert two_process_runs["at_exit"] == [{"group_initialized": False, "gloo_threads": []}] * 2


@pytest.mark.e2e
@pytest.mark.parametrize("scenario", [name for name in SCENARIOS if name not in LAUNCHED_SHARDED])
def test_two_processes_train_like_one(two_process_runs, tiny_model_dir, tmp_path, scenario):
    """Weights after 2 steps, advantages, completions and logged metrics: 2 processes == 1 process."""
    if scenario not in RUNNABLE:
        pytest.skip("grouprl serve needs fastapi and uvicorn (pip install 'grouprl[serve]')")
    single = run(scenario, str(tmp_path), str(tiny_model_dir))
    rank0, rank1 = two_process_runs[scenario]
    assert rank0["processes"] == 2
    for step, whole in enumerate(single["seen"]):
        parts = [rank0["seen"][step], rank1["seen"][step]]
        # the middle group of 3 is cut by the process boundary: 2 of its 4 samples
        # on each process (GFPO: 1 of its 2 kept)
        assert parts[0]["group_ids"][-1] == parts[1]["group_ids"][0] and parts[0]["num_samples"][-1] == (
            1 if scenario == "gfpo" else 2
        )
        assert parts[0]["completions"] + parts[1]["completions"] == whole["completions"]
        joined = torch.cat([parts[0]["advantages"], parts[1]["advantages"]])
        assert torch.allclose(joined, whole["advantages"], atol=1e-6), (joined, whole["advantages"])
        assert whole["advantages"].abs().sum() > 0
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0  # DDP kept the replicas identical
    if scenario == "grpo_tool_images":
        check_tool_image_runs(rank0, rank1)
    if scenario.startswith("grpo_images"):  # the process without images runs the vision tower on a probe image
        check_image_runs(rank0, rank1, image_on_process=1 if scenario.endswith("_server") else 0)
    if "resumed_weights" in single:  # 2 steps == 1 step, checkpoint, resume, 1 step; on each process
        for result in (single, rank0, rank1):
            assert max_difference(result["weights"], result["resumed_weights"]) == 0.0
        return  # one generation split over 2 optimizer steps: which rows share a step depends on the process count
    assert max_difference(single["weights"], rank0["weights"]) < 2e-6
    logged = [e for e in single["log_history"] if "loss" in e]
    logged2 = [e for e in rank0["log_history"] if "loss" in e]
    for one, two in zip(logged, logged2):
        for name in ("loss", "reward", "reward_std", "completions/mean_length", "frac_reward_zero_std", "num_tokens"):
            assert one[name] == pytest.approx(two[name], abs=1e-5), name


def deepspeed_path() -> str | None:
    """Where DeepSpeed is importable from: GROUPRL_DEEPSPEED_PATH (CI installs it there with --target, apart from
    the main environment), '' when it is installed here, None when it is not."""
    path = os.environ.get("GROUPRL_DEEPSPEED_PATH")
    if path and os.path.isdir(os.path.join(path, "deepspeed")):
        return path
    return "" if importlib.util.find_spec("deepspeed") is not None else None


NO_DEEPSPEED = "DeepSpeed is not installed (CI installs deepspeed==0.19.8 and names it in GROUPRL_DEEPSPEED_PATH)"
SHARDING = [
    pytest.param(name, marks=pytest.mark.skipif(name != "fsdp2" and deepspeed_path() is None, reason=NO_DEEPSPEED))
    for name in SHARDED
]


def sharding_config(name: str, directory) -> str:
    """The accelerate config file of grouprl's bundled sharding config `name` as the tests launch it."""
    return gathering_every_forward(directory) if name == "zero3" else resolve_accelerate_config(name)


def gathering_every_forward(directory) -> str:
    """The bundled zero3 config with DeepSpeed's settings in a file of their own that sets
    stage3_param_persistence_threshold to 0: by default ZeRO-3 keeps every parameter under 100k elements whole on each
    process, which is every parameter of the tiny test model, so no forward would gather anything; a real model's
    layers are gathered in each forward."""
    bundled = yaml.safe_load(open(resolve_accelerate_config("zero3"), encoding="utf-8"))
    settings = {
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "stage3_gather_16bit_weights_on_model_save": bundled["deepspeed_config"]["zero3_save_16bit_model"],
        },
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "zero_allow_untested_optimizer": True,
    }
    (directory / "zero3.json").write_text(json.dumps(settings), encoding="utf-8")
    bundled["deepspeed_config"] = {
        "deepspeed_config_file": str(directory / "zero3.json"),
        "zero3_init_flag": bundled["deepspeed_config"]["zero3_init_flag"],
        "deepspeed_multinode_launcher": bundled["deepspeed_config"]["deepspeed_multinode_launcher"],
    }
    bundled.pop("mixed_precision")
    (directory / "zero3.yaml").write_text(yaml.safe_dump(bundled), encoding="utf-8")
    return str(directory / "zero3.yaml")


@pytest.fixture(scope="module")
def sharded_runs(tiny_model_dir, tmp_path_factory, monkeypatch_session, request):
    """A sharding config's scenarios on 2 CPU processes, launched with grouprl's bundled config of that name (fsdp2,
    zero2, zero3), each launch once."""
    done = {}
    if HAS_SERVER_LIBRARIES:
        monkeypatch_session.setenv("GROUPRL_TEST_SERVER", request.getfixturevalue("grouprl_server")[0])
    monkeypatch_session.setenv("GROUPRL_TEST_TOOL_MODEL", str(request.getfixturevalue("tool_model_dir")))
    monkeypatch_session.setenv("GROUPRL_TEST_VLM_MODEL", str(request.getfixturevalue("qwen2_vl_model_dir")))

    def launched(config_name: str) -> dict:
        if config_name not in done:
            out = tmp_path_factory.mktemp(config_name)
            result = launch(
                2,
                [WORKER, str(out), str(tiny_model_dir), *SHARDED[config_name]],
                240,
                sharding_config(config_name, out),
            )
            assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
            done[config_name] = {
                name: [torch.load(out / f"{name}-2p-rank{r}.pt", weights_only=False) for r in range(2)]
                for name in SHARDED[config_name]
            }
        return done[config_name]

    return launched


def launched_scenarios(match) -> list:
    """(sharding config, scenario) for each launched scenario whose name past its config's (`kind`: '', '_sampled',
    ...) satisfies `match`, marked as its config is."""
    return [
        pytest.param(config.values[0], scenario, marks=config.marks, id=scenario)
        for config in SHARDING
        for scenario in SHARDED[config.values[0]]
        if match(scenario.removeprefix(config.values[0]))
    ]


def trained_away_from_the_start(weights: dict, model_dir) -> bool:
    """A run's final weights are off the starting model's (QLoRA runs record their adapters only: lora_B starts at
    zero)."""
    if all("lora_" in name for name in weights):
        return max(t.abs().max().item() for name, t in weights.items() if "lora_B" in name) > 1e-3
    return max_difference(parameters(AutoModelForCausalLM.from_pretrained(model_dir)), weights) > 1e-3


@pytest.mark.e2e
@pytest.mark.parametrize("config_name, scenario", launched_scenarios(lambda kind: kind in ("",) + VARIANTS))
def test_sharded_two_processes_train_like_one(sharded_runs, config_name, scenario, tiny_model_dir, tmp_path):
    """accelerate's FSDP2 and DeepSpeed ZeRO-2 / ZeRO-3 (grouprl's bundled configs; ZeRO-3's gathering in every
    forward, `gathering_every_forward`) over gloo: each really runs
    (the weights sharded, except ZeRO-2's), and 2 steps with a reference model (beta 0.1; under ZeRO-3 in its own
    inference engine) give the 1-process run's weights and logged statistics. GA is 2: the accumulation boundary
    that grouprl drives. The same for the algorithm variants (`*_dynamic`, `*_gfpo`, `*_sync_ref`) and for QLoRA
    (`*_qlora`: a 4-bit policy with LoRA adapters, checkpointed at step 1 and resumed)."""
    single = run(scenario, str(tmp_path), str(tiny_model_dir))
    rank0, rank1 = sharded_runs(config_name)[scenario]
    if "resumed_weights" in single:  # 2 steps == 1 step, checkpoint, resume, 1 step; on each process
        for result in (single, rank0, rank1):
            assert max_difference(result["weights"], result["resumed_weights"]) == 0.0
    if scenario.endswith("_qlora"):  # save_model wrote the adapters, whole, for PEFT to load onto the 4-bit base
        from safetensors.torch import load_file

        saved = load_file(os.path.join(rank0["saved_model"], "adapter_model.safetensors"))
        assert {name.replace(".default", "") for name in rank0["weights"]} == set(saved)
        assert all(torch.equal(t, saved[name.replace(".default", "")]) for name, t in rank0["weights"].items())
    expected = "DistributedType.FSDP" if config_name == "fsdp2" else "DistributedType.DEEPSPEED"
    assert rank0["distributed_type"] == rank1["distributed_type"] == expected
    assert rank0["sharded"] == rank1["sharded"] == (config_name != "zero2")  # ZeRO-2 shards the optimizer only
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0
    # QLoRA: 2.1e-5 measured on adapters of magnitude ~1 (fp32 LoRA around the 4-bit layers), the others under 2e-6
    assert max_difference(single["weights"], rank0["weights"]) < (1e-4 if scenario.endswith("_qlora") else 2e-6)
    assert trained_away_from_the_start(rank0["weights"], tiny_model_dir)
    logged = [e for e in single["log_history"] if "loss" in e]
    logged2 = [e for e in rank0["log_history"] if "loss" in e]
    assert len(logged) == len(logged2) == 2
    # not kl nor entropy: TRL logs the mean over processes of each process's token mean, which depends on the split;
    # the reference model's part in the update shows in the weights
    for one, two in zip(logged, logged2):
        for name in ("loss", "reward", "grad_norm"):
            assert one[name] == pytest.approx(two[name], abs=1e-5), name


@pytest.mark.parametrize("config_name, scenario", launched_scenarios(lambda kind: kind in ("_tools", "_environment")))
def test_sharded_tool_calling_rollouts_train_like_one_process(
    sharded_runs, config_name, scenario, tool_model_dir, tmp_path
):
    """TRL's tools and environment_factory under FSDP2 / ZeRO-3: every even sample's first turn calls the tool and the
    turn after its result follows the conversation, on whichever process the row falls (the middle group straddles
    them). 2 processes train on the 1-process run's completions and tool masks and give its weights; the tool results
    and the template's glue around them are masked out of the loss."""
    single = run(scenario, str(tmp_path), str(tool_model_dir))
    rank0, rank1 = sharded_runs(config_name)[scenario]
    assert rank0["sharded"] and rank1["sharded"]
    assert len(single["seen"]) == len(rank0["seen"]) == len(rank1["seen"]) == 2
    for whole, part0, part1 in zip(single["seen"], rank0["seen"], rank1["seen"]):
        assert part0["completions"] + part1["completions"] == whole["completions"]
        assert part0["tool_masks"] + part1["tool_masks"] == whole["tool_masks"]
        masked = [mask.count(False) for mask in whole["tool_masks"]]
        # the even samples of each group called the tool: the result's glue is masked, the odd ones are all sampled
        assert all(count > 0 for count in masked[::2]) and not any(masked[1::2]), masked
        for part in (part0, part1):
            assert part["advantages"].abs().sum() > 0
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0
    assert max_difference(single["weights"], rank0["weights"]) < 2e-6
    assert trained_away_from_the_start(rank0["weights"], tool_model_dir)
    logged = [e for e in single["log_history"] if "loss" in e]
    logged2 = [e for e in rank0["log_history"] if "loss" in e]
    assert len(logged) == len(logged2) == 2
    for one, two in zip(logged, logged2):
        for name in ("loss", "reward", "grad_norm", "tools/call_frequency"):
            assert one[name] == pytest.approx(two[name], abs=1e-5), name
        assert one["tools/call_frequency"] > 0


@pytest.mark.parametrize("config_name, scenario", launched_scenarios(lambda kind: kind == "_images"))
def test_sharded_image_prompts_train_like_one_process(sharded_runs, config_name, scenario, tiny_model_dir, tmp_path):
    """Image prompts (a tiny Qwen2-VL) under FSDP2 / ZeRO-3: only the first prompt of each generation has an image, so
    process 1's rows have none. Its forwards still run the sharded vision tower (on a probe image whose row is
    dropped: without it the processes' weight gathers came apart and the run aborted), and logging gathers the images
    column on both processes (a process without images skipped it: a hang too). 2 processes give the 1-process run's
    completions, advantages and weights, vision tower included."""
    single = run(scenario, str(tmp_path), str(tiny_model_dir))
    rank0, rank1 = sharded_runs(config_name)[scenario]
    assert rank0["sharded"] and rank1["sharded"]
    for whole, part0, part1 in zip(single["seen"], rank0["seen"], rank1["seen"], strict=True):
        assert part0["completions"] + part1["completions"] == whole["completions"]
        joined = torch.cat([part0["advantages"], part1["advantages"]])
        assert torch.allclose(joined, whole["advantages"], atol=1e-6) and joined.abs().sum() > 0
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0
    assert max_difference(single["weights"], rank0["weights"]) < 2e-6
    check_image_runs(rank0, rank1)


def check_image_runs(rank0: dict, rank1: dict, image_on_process: int = 0) -> None:
    """One process had one group's image in each generation (its first group on process 0, its last on process 1),
    the other none; the vision tower trained all the same."""
    expected = ([True, False], [False, False]) if image_on_process == 0 else ([False, False], [False, True])
    for part0, part1 in zip(rank0["seen"], rank1["seen"], strict=True):
        assert (part0["with_images"], part1["with_images"]) == expected
    start = {name: p.detach() for name, p in vlm_models.tiny_qwen2_vl()[0].named_parameters()}
    moved = {name for name, t in rank0["weights"].items() if not torch.equal(t, start[name])}
    assert any(".visual." in name for name in moved) and any(".language_model." in name for name in moved)


def check_tool_image_runs(rank0: dict, rank1: dict) -> None:
    """Both processes trained rows with a tool's image, some with the prompt's too; the language model moved."""
    counts = [step["rollout_images"] for step in rank0["seen"] + rank1["seen"]]
    assert all(1 in c for c in counts) and any(2 in c for c in counts), counts
    start = {name: p.detach() for name, p in vlm_models.tiny_qwen2_vl()[0].named_parameters()}
    assert any(".language_model." in n for n, t in rank0["weights"].items() if not torch.equal(t, start[n]))


@pytest.mark.parametrize("config_name", SHARDING)
def test_sharded_checkpoint_resumes_and_saves_a_whole_model(sharded_runs, config_name):
    """A checkpoint of a sharded run holds the whole model (from_pretrained-loadable) and AdamW's whole state (FSDP2:
    gathered, keyed by name; DeepSpeed: its own per-process shards in deepspeed/): resuming from it on 2 processes
    gives the weights of not stopping, on each process; save_model writes the whole model."""
    rank0, rank1 = sharded_runs(config_name)[f"{config_name}_resume"]
    assert rank0["sharded"] == rank1["sharded"] == (config_name != "zero2")
    for result in (rank0, rank1):
        assert max_difference(result["weights"], result["resumed_weights"]) == 0.0
    saved = parameters(AutoModelForCausalLM.from_pretrained(rank0["saved_model"]))
    assert max_difference(saved, rank0["weights"]) == 0.0
    checkpoint = os.path.join(os.path.dirname(rank0["saved_model"]), "checkpoint-1")
    at_step_1 = parameters(AutoModelForCausalLM.from_pretrained(checkpoint))
    assert max_difference(at_step_1, rank0["weights"]) > 1e-3
    state = torch.load(os.path.join(checkpoint, "training_state.pt"), weights_only=False)
    if config_name == "fsdp2":
        assert state["optimizer_keys"] == "names"
        assert set(state["optimizer"]["state"]) == set(saved) - {"lm_head.weight"}  # every parameter's, whole
    else:
        assert state["optimizer_keys"] == "deepspeed" and state["optimizer"] is None
        shards = os.listdir(os.path.join(checkpoint, "deepspeed", "deepspeed"))
        assert {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)} <= set(shards)


SAMPLED = launched_scenarios(lambda kind: kind.startswith("_sampled"))


@pytest.mark.parametrize("config_name, scenario", SAMPLED)
def test_sharded_policy_samples_from_a_replica_of_its_gathered_weights(
    sharded_runs, config_name, scenario, tiny_model_dir
):
    """In-process sampling (generation_engine='auto') under FSDP2 and ZeRO-3 (each also with LoRA) on 2 processes: each
    process samples from an unsharded replica whose weights are, after every sync, exactly the policy's gathered
    (LoRA: merged) ones, and freed while the step trains; process 1 sampling once more on its own hangs nothing (no
    collective in sampling); the replica's logprobs are the training model's (fp32: the importance-sampling ratio is
    1); the steps train. `_cb`: transformers continuous batching samples from the replica (no sampler logprobs to
    correct with: the replica's weights are the policy's)."""
    rank0, rank1 = sharded_runs(config_name)[scenario]
    continuous_batching = scenario.endswith("_cb")
    for result in (rank0, rank1):
        assert result["backend"] == "ShardedPolicySampler"
        assert (result["replica_sampler"] == "ContinuousBatchingGenerator") == continuous_batching
        syncs = result["syncs"]
        assert len(syncs) == 2, syncs  # one per optimizer step
        assert all(sync["sharded"] and sync["difference"] == 0.0 for sync in syncs), syncs
        assert syncs[0]["checksum"] != syncs[1]["checksum"]  # the second sync brought the first step's update
        assert [sync["freed_before"] for sync in syncs] == [False, True]  # freed while the first step trained
    assert [sync["checksum"] for sync in rank0["syncs"]] == [sync["checksum"] for sync in rank1["syncs"]]
    assert [sync["sampled_alone"] for sync in rank1["syncs"]] == [3, 3]
    logged = [entry for entry in rank0["log_history"] if "loss" in entry]
    assert len(logged) == 2
    for entry in logged:
        if continuous_batching:
            assert "sampling/sampling_logp_difference/max" not in entry
            continue
        assert entry["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-4), entry
        assert entry["sampling/sampling_logp_difference/max"] < 1e-4, entry
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0
    assert max_difference(parameters(AutoModelForCausalLM.from_pretrained(tiny_model_dir)), rank0["weights"]) > 1e-3


LOCKSTEP = launched_scenarios(lambda kind: kind in ("_lockstep", "_lockstep_lora", "_lockstep_qlora"))


@pytest.mark.parametrize("config_name, scenario", LOCKSTEP)
def test_sharded_policy_samples_in_lockstep_without_gathering_its_weights(
    sharded_runs, config_name, scenario, tiny_model_dir
):
    """ds3_gather_for_generation=False under FSDP2 and ZeRO-3 (and with LoRA) on 2 processes: each process samples from
    the sharded policy itself, in one call per generation (its 6 rows, one a prompt); process 1's rows stop after 3
    tokens and process 0's run to 8, and a call without rows on process 0, hang nothing; seeded samples equal those of
    an unsharded copy of the current gathered weights (the second generation's after the first step's update); no
    sampler correction (the samples come from the trained weights); the steps train."""
    rank0, rank1 = sharded_runs(config_name)[scenario]
    quantized = scenario.endswith("_qlora")  # no unsharded copy of a 4-bit policy to compare samples with
    for result, longest in ((rank0, 8), (rank1, 3)):
        assert result["backend"] == "TransformersGenerator" and result["syncs"] == []
        samples = result["samples"]
        assert len(samples) == 2, samples  # one call per generation, one generation per optimizer step
        for sample in samples:
            assert sample["sharded"] and sample["rows"] == 6 and sample["num_samples"] == 1
            assert max(sample["lengths"]) == longest, sample["lengths"]
            if not quantized:
                assert sample["seeded"] == sample["unsharded_seeded"]  # the same tokens for the same random draws
                assert len({token for row in sample["seeded"] for token in row}) > 6  # no degenerate sampling
        if not quantized:
            assert samples[0]["checksum"] != samples[1]["checksum"]  # the second generation's weights are updated
    if not quantized:
        assert [sample["without_rows"] for sample in rank0["samples"]] == [0, 0]
        assert [sample["without_rows"] for sample in rank1["samples"]] == [6, 6]
    logged = [entry for entry in rank0["log_history"] if "loss" in entry]
    assert len(logged) == 2 and not any(name.startswith("sampling/") for name in logged[0]), logged[0]
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0
    assert trained_away_from_the_start(rank0["weights"], tiny_model_dir)


@pytest.mark.parametrize(
    "config_name, scenario",
    launched_scenarios(lambda kind: kind in ("_lockstep_dynamic", "_lockstep_gfpo", "_lockstep_sync_ref")),
)
def test_the_algorithm_variants_sample_in_lockstep(sharded_runs, config_name, scenario, tiny_model_dir):
    """Dynamic sampling (its extra rounds), GFPO (its filter) and a synced reference, each process sampling from the
    sharded policy in step (process 1's rows stop early): the runs end, as many sampling calls on both processes (one
    alone would hang), each one's seeded samples those of an unsharded copy of the gathered weights, the same
    weights on both processes, moved from the start."""
    rank0, rank1 = sharded_runs(config_name)[scenario]
    for result in (rank0, rank1):
        assert result["backend"] == "TransformersGenerator" and result["samples"]
        for sample in result["samples"]:
            assert sample["sharded"] and sample["seeded"] == sample["unsharded_seeded"]
    assert len(rank0["samples"]) == len(rank1["samples"])
    logged = [entry for entry in rank0["log_history"] if "loss" in entry]
    assert len(logged) == 2
    if scenario.endswith("_dynamic"):  # odd prompts tie: a second round of 12 completions, in step (2 at most)
        drawn = [entry["dynamic_sampling/completions_drawn"] for entry in logged]
        assert max(drawn) == 24 and sum(drawn) / 12 == len(rank0["samples"]), drawn
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0
    assert trained_away_from_the_start(rank0["weights"], tiny_model_dir)


SERVED = launched_scenarios(lambda kind: kind == "_server")


@pytest.mark.parametrize("config_name, scenario", SERVED)
def test_sharded_policy_trains_against_a_generation_server(
    sharded_runs, config_name, scenario, tiny_model_dir, tmp_path
):
    """TRL's everyday multi-GPU setup in miniature: the policy sharded over 2 processes (FSDP2, ZeRO-3) while a
    separate server (grouprl serve) samples. Each weight sync gathers the shards on both processes and the main
    process alone sends them: after every sync the server scores a fixed sequence as the gathered policy does (the
    second sync's weights differ from the first's), and 2 steps give the 1-process run's weights."""
    rank0, rank1 = sharded_runs(config_name)[scenario]
    assert rank0["sharded"] and rank1["sharded"]
    assert rank0["backend"] == rank1["backend"] == "RemoteGenerator"
    syncs = rank0["syncs"]
    assert len(syncs) == 2 and rank1["syncs"] == []
    for sync in syncs:
        assert torch.allclose(sync["server"], sync["policy"], atol=1e-4), (sync["server"], sync["policy"])
    assert (syncs[0]["policy"] - syncs[1]["policy"]).abs().max() > 1e-3
    single = run(scenario, str(tmp_path), str(tiny_model_dir))
    assert max_difference(single["weights"], rank0["weights"]) < 2e-6
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0
    assert max_difference(parameters(AutoModelForCausalLM.from_pretrained(tiny_model_dir)), rank0["weights"]) > 1e-3


def test_the_steps_change_the_weights(two_process_runs, tiny_model_dir):
    base = parameters(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    for name in RUNNABLE:
        if "images" not in name:  # another model's weights: check_image_runs / check_tool_image_runs see them move
            assert max_difference(base, two_process_runs[name][0]["weights"]) > 1e-3, name


@pytest.mark.e2e
@pytest.mark.skipif(
    not HAS_SERVER_LIBRARIES, reason="grouprl serve needs fastapi and uvicorn (pip install 'grouprl[serve]')"
)
def test_two_nodes_on_loopback_with_a_generation_server_train_like_one(
    grouprl_server, tiny_model_dir, tmp_path, monkeypatch
):
    """TRL's multi-node recipe in miniature: two `accelerate launch --num_machines 2 --machine_rank {0,1}
    --main_process_ip 127.0.0.1` commands, one process each, train as two nodes while a third process (grouprl
    serve) samples for them; the weights after 2 steps equal one process's."""
    monkeypatch.setenv("GROUPRL_TEST_SERVER", grouprl_server[0])
    out, port = tmp_path / "nodes", str(free_port())
    env = {**os.environ, **LAUNCH_ENV}
    nodes = [
        subprocess.Popen(
            accelerate_launch(
                2,
                ["--num_machines", "2", "--machine_rank", str(rank)]
                + ["--main_process_ip", "127.0.0.1", "--main_process_port", port],
                [WORKER, str(out), str(tiny_model_dir), "grpo_server"],
            ),
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        logs = [node.communicate(timeout=180)[0] for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(log[-3000:] for log in logs)
    rank0, rank1 = (torch.load(out / f"grpo_server-2p-rank{r}.pt", weights_only=False) for r in range(2))
    single = run("grpo_server", str(tmp_path / "one"), str(tiny_model_dir))
    assert rank0["processes"] == 2 and max_difference(rank0["weights"], rank1["weights"]) == 0.0
    assert max_difference(single["weights"], rank0["weights"]) < 2e-6
    assert max_difference(single["weights"], parameters(AutoModelForCausalLM.from_pretrained(tiny_model_dir))) > 1e-3
