"""GRPOConfig defaults (TRL 1.16), parsing, validation and the batch plan."""

import pytest
from transformers import HfArgumentParser

from grouprl import GRPOConfig, plan_batches
from grouprl.config.grpo_config import NOT_YET_BUILT

TRL_DEFAULTS = {
    "learning_rate": 1e-6,
    "logging_steps": 10,
    "gradient_checkpointing": True,
    "bf16": True,
    "remove_unused_columns": False,
    "num_generations": 8,
    "max_completion_length": 512,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": None,
    "repetition_penalty": 1.0,
    "beta": 0.0,
    "epsilon": 0.2,
    "epsilon_high": None,
    "delta": None,
    "loss_type": "dapo",
    "importance_sampling_level": "token",
    "scale_rewards": "group",
    "num_iterations": 1,
    "mask_truncated_completions": False,
    "multi_objective_aggregation": "sum_then_normalize",
    "top_entropy_quantile": 1.0,
    "use_bias_correction_kl": True,
    "shuffle_dataset": True,
    "generation_batch_size": 8,
    "steps_per_generation": 1,  # resolved, as TRL
    "sync_ref_model": False,
    "ref_model_mixup_alpha": 0.6,
    "ref_model_sync_steps": 512,
    "vllm_mode": "colocate",
    "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_importance_sampling_clip_max": 3.0,
    "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05,
    "vespo_k_pos": 2.0,
    "vespo_lambda_pos": 3.0,
    "vespo_k_neg": 3.0,
    "vespo_lambda_neg": 2.0,
    "entropy_target": 0.2,
    "entropy_coef_delta": 0.005,
    "per_device_train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "max_grad_norm": 1.0,
    "seed": 42,
    "save_steps": 500,
    "lr_scheduler_type": "linear",
    "num_train_epochs": 3.0,
    "max_steps": -1,
}


def test_defaults_match_trl():
    config = GRPOConfig()
    for name, value in TRL_DEFAULTS.items():
        assert getattr(config, name) == value, name
    assert GRPOConfig(fp16=True).bf16 is False


@pytest.mark.parametrize("given,expected", [(True, "group"), (False, "none"), ("batch", "batch"), ("none", "none")])
def test_scale_rewards_aliases(given, expected):
    assert GRPOConfig(scale_rewards=given).scale_rewards == expected


def test_hf_argument_parser_round_trip():
    parser = HfArgumentParser(GRPOConfig)
    (config,) = parser.parse_args_into_dataclasses(
        args=[
            "--output_dir",
            "x",
            "--num_generations",
            "4",
            "--loss-type",
            "grpo",
            "--scale_rewards",
            "false",
            "--generation_kwargs",
            '{"top_k": 5}',
            "--reward_weights",
            "1.0",
            "0.5",
            "--report_to",
            "tensorboard",
            "--no_gradient_checkpointing",
        ]
    )
    assert (config.num_generations, config.loss_type, config.scale_rewards) == (4, "grpo", "none")
    assert config.generation_kwargs == {"top_k": 5}
    assert config.reward_weights == [1.0, 0.5]
    assert config.report_to == ["tensorboard"]
    assert config.gradient_checkpointing is False


def test_not_yet_built_features_raise_not_implemented():
    """Every TRL field is built now; the mechanism stays for the next one, checked with a stand-in entry."""
    assert NOT_YET_BUILT == {}
    built = GRPOConfig(
        ds3_gather_for_generation=False,
        use_transformers_continuous_batching=True,
        log_completions=True,
        log_completions_hub_repo="me/completions",
    )
    assert not built.ds3_gather_for_generation and built.use_transformers_continuous_batching
    NOT_YET_BUILT["top_k"] = (0, "a stand-in feature")
    try:
        with pytest.raises(NotImplementedError, match=r"GRPOConfig.top_k=5: a stand-in feature is not available"):
            GRPOConfig(top_k=5)
    finally:
        del NOT_YET_BUILT["top_k"]


def test_tool_fields_are_built():
    assert "max_tool_calling_iterations" not in NOT_YET_BUILT
    assert GRPOConfig(max_tool_calling_iterations=3).max_tool_calling_iterations == 3
    with pytest.raises(ValueError, match="max_tool_calling_iterations=-1 must be >= 0"):
        GRPOConfig(max_tool_calling_iterations=-1)


def test_objective_fields_are_built():
    for name in (
        "beta",
        "sync_ref_model",
        "importance_sampling_level",
        "delta",
        "top_entropy_quantile",
        "entropy_coef",
        "use_adaptive_entropy",
        "off_policy_mask_threshold",
        "router_aux_loss_coef",
        "cast_lm_head_to_fp32",
    ):
        assert name not in NOT_YET_BUILT, name
    GRPOConfig(
        beta=0.1,
        importance_sampling_level="sequence",
        loss_type="grpo",
        delta=2.0,
        top_entropy_quantile=0.2,
        entropy_coef=0.01,
        use_adaptive_entropy=True,
        off_policy_mask_threshold=0.5,
        cast_lm_head_to_fp32=True,
    )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_generations": 1}, "num_generations=1"),
        ({"loss_type": "ppo"}, "loss_type"),
        (
            {"generation_batch_size": 24, "steps_per_generation": 2},
            "either generation_batch_size or steps_per_generation",
        ),
        ({"temperature": 0.0}, "temperature"),
        ({"generation_kwargs": "{not json"}, "generation_kwargs"),
        ({"bf16": True, "fp16": True}, "bf16 and fp16"),
        ({"sync_ref_model": True}, "sync_ref_model=True needs a reference model"),
        ({"top_entropy_quantile": 1.5}, "top_entropy_quantile"),
        (
            {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": None},
            "clip_min and/or",
        ),
        ({"vllm_importance_sampling_clip_min": 4.0}, "must be < vllm_importance_sampling_clip_max"),
        ({"entropy_coef_min": 0.5, "entropy_coef_max": 0.1}, "entropy_coef_min"),
        ({"max_dynamic_sampling_rounds": -1}, "max_dynamic_sampling_rounds"),
    ],
)
def test_invalid_fields_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GRPOConfig(**kwargs)


def test_plan_defaults_follow_trl():
    plan = plan_batches(
        GRPOConfig(per_device_train_batch_size=8, gradient_accumulation_steps=2, num_generations=4), num_processes=2
    )
    assert plan.steps_per_generation == 2  # defaults to GA
    assert plan.completions_per_generation == 8 * 2 * 2
    assert plan.prompts_per_generation == 8
    assert not plan.old_logprobs_needed  # spg == GA and one iteration: on-policy


def test_plan_from_generation_batch_size():
    plan = plan_batches(
        GRPOConfig(per_device_train_batch_size=4, generation_batch_size=32, num_generations=8), num_processes=2
    )
    assert plan.steps_per_generation == 4
    assert plan.old_logprobs_needed  # GA 1 % (4 * 1) != 0: reused off-policy


@pytest.mark.parametrize(
    "kwargs,needed",
    [
        ({"gradient_accumulation_steps": 2, "steps_per_generation": 1}, False),
        ({"gradient_accumulation_steps": 1, "steps_per_generation": 2}, True),
        ({"gradient_accumulation_steps": 2, "num_iterations": 2}, True),
    ],
)
def test_old_logprobs_rule(kwargs, needed):
    config = GRPOConfig(per_device_train_batch_size=8, num_generations=4, **kwargs)
    assert plan_batches(config).old_logprobs_needed is needed


def test_indivisible_generation_batch_names_fields_and_valid_values():
    with pytest.raises(ValueError) as err:
        plan_batches(GRPOConfig(per_device_train_batch_size=3, num_generations=4))
    message = str(err.value)
    assert "num_generations=4" in message and "per_device_train_batch_size" in message
    assert "Valid num_generations for this batch: [3]" in message
    assert "[4, 8, 12, 16]" in message  # per-device sizes that work with G=4


def test_generation_batch_size_must_divide_by_processes():
    with pytest.raises(ValueError, match="divisible by per_device_train_batch_size"):
        plan_batches(
            GRPOConfig(per_device_train_batch_size=4, generation_batch_size=12, num_generations=4), num_processes=2
        )


def test_plan_description_mentions_sizes():
    plan = plan_batches(GRPOConfig(per_device_train_batch_size=8, num_generations=4))
    text = plan.describe(num_prompts=20)
    assert "2 prompts x 4 completions = 8 completions" in text
    assert "20 prompts -> 10 optimizer steps" in text


def test_an_epochs_last_step_takes_the_micro_batches_left():
    """TRL's test_prepare_input_called_with_correct_data: 17 prompts, 6 per generation -> 2 generations of 4 x 2
    micro-batches = 16 per epoch; GA 3 -> 6 steps of 3, 3, 3, 3, 3, 1 (transformers' epoch remainder)."""
    plan = plan_batches(
        GRPOConfig(
            per_device_train_batch_size=6,
            num_generations=4,
            steps_per_generation=4,
            num_iterations=2,
            gradient_accumulation_steps=3,
        )
    )
    micro = plan.micro_steps_per_epoch(17)
    assert micro == 16 and plan.optimizer_steps_per_epoch(17) == 6
    assert [plan.micro_batches_in_step(step, micro) for step in range(12)] == [3, 3, 3, 3, 3, 1] * 2
    assert plan.micro_batches_in_step(5, None) == 3  # a stream has no epochs
    assert "17 prompts -> 6 optimizer steps (the last takes the 1 micro-batch(es) left)" in plan.describe(17)
    # a whole number of steps per epoch: every step takes GA
    assert {plan.micro_batches_in_step(step, plan.micro_steps_per_epoch(18)) for step in range(16)} == {3}


@pytest.mark.parametrize(
    "kwargs,fragment",
    [
        ({"loss_type": "luspo"}, "luspo' is meant for importance_sampling_level='sequence'"),
        (
            {"loss_type": "vespo", "importance_sampling_level": "sequence"},
            "vespo' computes its own sequence-level weight",
        ),
        ({"loss_type": "dapo", "importance_sampling_level": "sequence"}, "GSPO uses loss_type='grpo'"),
        ({"loss_type": "bnpo", "importance_sampling_level": "sequence"}, "GSPO uses loss_type='grpo'"),
        ({"loss_type": "dr_grpo", "importance_sampling_level": "sequence"}, "GSPO uses loss_type='grpo'"),
        (
            {"loss_type": "cispo", "importance_sampling_level": "sequence", "epsilon_high": 5.0},
            "GSPO uses loss_type='grpo'",
        ),
        ({"loss_type": "cispo"}, "epsilon_high"),
        ({"delta": 1.1}, "delta=1.1 is not above"),
    ],
)
def test_dubious_combinations_warn(kwargs, fragment):
    messages = GRPOConfig(**kwargs).dubious_combinations()
    assert any(fragment in m for m in messages), messages


@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"loss_type": "grpo", "importance_sampling_level": "sequence"},
        {"loss_type": "luspo", "importance_sampling_level": "sequence"},
        {"loss_type": "cispo", "epsilon_high": 5.0},
        {"delta": 2.0},
    ],
)
def test_sensible_combinations_do_not_warn(kwargs):
    assert GRPOConfig(**kwargs).dubious_combinations() == []


@pytest.mark.parametrize("value", ["auto", "none", None, "null"])
def test_pad_to_multiple_of_no_padding_values_are_accepted(value):
    assert GRPOConfig(pad_to_multiple_of=value).pad_to_multiple_of is None


@pytest.mark.parametrize("value,expected", [(64, 64), ("8", 8)])
def test_pad_to_multiple_of_an_integer_is_kept(value, expected):
    # built (tests/test_padding.py): the training batch and every training forward are padded to multiples of it
    assert GRPOConfig(pad_to_multiple_of=value).pad_to_multiple_of == expected


@pytest.mark.parametrize("value", [0, -8, "eight"])
def test_pad_to_multiple_of_must_be_a_positive_integer(value):
    with pytest.raises(ValueError, match="pad_to_multiple_of=.* must be a positive integer"):
        GRPOConfig(pad_to_multiple_of=value)


def test_replace_and_dict_round_trip_keep_bf16_from_default():
    import dataclasses

    default = GRPOConfig(output_dir="x", report_to="none")
    assert default.bf16 and default.bf16_from_default
    assert dataclasses.replace(
        default, num_generations=4
    ).bf16_from_default  # was lost: replace passes the resolved bf16=True
    assert GRPOConfig(
        **{
            k: v
            for k, v in default.to_dict().items()
            if k in {f.name for f in dataclasses.fields(GRPOConfig) if f.init}
        }
    ).bf16_from_default
    assert not dataclasses.replace(default, bf16=False).bf16_from_default  # bf16 changed: no longer the default's value
    explicit = GRPOConfig(output_dir="x", bf16=True)
    assert not explicit.bf16_from_default and not dataclasses.replace(explicit, num_generations=4).bf16_from_default


def test_field_types_are_checked_at_construction(tmp_path, caplog, monkeypatch):
    from grouprl.config import field_types

    monkeypatch.setattr(field_types, "_warned", set())
    # a string that is not a number: refused naming the field, the value and the type, not inside torch's Adam
    with pytest.raises(ValueError, match=r"GRPOConfig.learning_rate='fast' must be a number \(float\), got the string"):
        GRPOConfig(output_dir=str(tmp_path), learning_rate="fast")
    with pytest.raises(ValueError, match=r"num_generations=2.5 must be an integer.*Pass e.g. num_generations=8"):
        GRPOConfig(output_dir=str(tmp_path), num_generations=2.5)
    with pytest.raises(ValueError, match=r"use_vllm='maybe' must be a bool"):
        GRPOConfig(output_dir=str(tmp_path), use_vllm="maybe")
    with pytest.raises(ValueError, match=r"beta=True must be a number \(float\), got bool True"):
        GRPOConfig(output_dir=str(tmp_path), beta=True)
    # a string that reads as a number (a YAML 1.1 "1e-5", a CLI habit): converted as the CLI does, with one warning
    config = GRPOConfig(output_dir=str(tmp_path), beta="0.04", learning_rate="1e-5", num_generations="4", bf16="false")
    assert (config.beta, config.learning_rate, config.num_generations, config.bf16) == (0.04, 1e-5, 4, False)
    assert type(config.beta) is float and type(config.num_generations) is int
    assert "GRPOConfig.beta='0.04' is a str, not a number (float); using 0.04" in caplog.text
    assert "Pass 0.04 to silence this" in caplog.text
    caplog.clear()
    GRPOConfig(output_dir=str(tmp_path), beta="0.04")
    assert "beta" not in caplog.text  # once per field
    # every default passes unchanged
    defaults = GRPOConfig(output_dir=str(tmp_path))
    assert (defaults.learning_rate, defaults.beta, defaults.max_steps) == (1e-6, 0.0, -1)
