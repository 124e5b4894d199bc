"""End-to-end GRPOTrainer runs on tiny local models: formats, metrics, resume, invariance, bad input."""

import json
import logging
import os

import datasets
import pytest
import torch
from helpers import ScriptedBackend, max_difference, parameters
from transformers import AutoModelForCausalLM, AutoTokenizer

from grouprl import GRPOConfig, GRPOTrainer, RewardFunctionError
from grouprl.data.prompts import DataRowError

TRL_STEP_METRICS = [
    "loss",
    "grad_norm",
    "learning_rate",
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "num_tokens",
    "entropy",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
    "step_time",
    "epoch",
    "step",
]


def distinct_tokens(completion_ids, **kwargs):
    return [float(len(set(ids))) for ids in completion_ids]


def make_config(tmp_path, **overrides):
    values = dict(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=6,
        num_generations=3,
        max_completion_length=8,
        learning_rate=0.1,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    values.update(overrides)
    return GRPOConfig(**values)


def prompts(n=12, conversational=False):
    texts = [f"{i}+{i % 5}=" for i in range(n)]
    rows = [[{"role": "user", "content": t}] for t in texts] if conversational else texts
    return datasets.Dataset.from_dict({"prompt": rows, "answer": [str(i + i % 5) for i in range(n)]})


@pytest.mark.parametrize("conversational", [False, True])
def test_train_both_formats_changes_every_parameter(tiny_model_dir, tmp_path, conversational):
    seen_columns = []

    def reward_with_column(completions, answer, **kwargs):
        seen_columns.append((type(completions[0]), len(answer)))
        return distinct_tokens(**kwargs)

    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_with_column,
        args=make_config(tmp_path, max_steps=3),
        train_dataset=prompts(conversational=conversational),
    )
    before = parameters(trainer.model)
    trainer.train()
    after = parameters(trainer.model)
    unchanged = [name for name in before if torch.equal(before[name], after[name])]
    assert not unchanged, f"parameters that did not train: {unchanged}"
    assert seen_columns[0] == ((list if conversational else str), 6)
    history = trainer.state.log_history
    for name in TRL_STEP_METRICS:
        assert name in history[0], name
    assert "rewards/reward_with_column/mean" in history[0]
    assert history[-1]["train_loss"] is not None and history[-1]["step"] == 3
    lines = [json.loads(line) for line in open(os.path.join(trainer.args.output_dir, "metrics.jsonl"))]
    assert [line["step"] for line in lines] == [1, 2, 3, 3]


def test_save_model_loads_with_from_pretrained(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path, max_steps=1),
        train_dataset=prompts(),
    )
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"))
    AutoTokenizer.from_pretrained(str(tmp_path / "final"))
    saved = parameters(model)
    for name, value in parameters(trainer.model).items():
        assert torch.equal(saved[name], value), name


def test_resume_continues_exactly(tiny_model_dir, tmp_path):
    """4 steps in one run == 3 steps, crash, resume, 1 step (with a generation straddling the checkpoint)."""
    common = dict(
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        steps_per_generation=3,
        per_device_train_batch_size=3,
        bf16=False,
    )

    full = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path / "a", **common),
        train_dataset=prompts(),
    )
    full.train()
    expected = parameters(full.model)

    def crash_after_step_2(completion_ids, trainer_state, **kwargs):
        if trainer_state.global_step >= 2:
            raise RuntimeError("simulated crash")
        return distinct_tokens(completion_ids)

    crashed = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=crash_after_step_2,
        args=make_config(tmp_path / "b", **common),
        train_dataset=prompts(),
    )
    with pytest.raises(
        RewardFunctionError, match="simulated crash(.|\n)*after step 3"
    ):  # the 2nd generation, in step 4
        crashed.train()
    # checkpoint-2 from save_steps, checkpoint-3 = the last good state, saved when the reward function failed
    assert sorted(os.listdir(tmp_path / "b" / "out")) == ["checkpoint-2", "checkpoint-3", "metrics.jsonl"]

    resumed = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path / "b", **common),
        train_dataset=prompts(),
    )
    resumed.train(
        resume_from_checkpoint=str(tmp_path / "b" / "out" / "checkpoint-2")
    )  # 1 micro-batch of a generation pending
    assert resumed.state.global_step == 4
    assert max_difference(expected, parameters(resumed.model)) == 0.0

    # log history restored and continued: every entry equal except wall-clock timings (and the crashing function's name)
    def untimed(history):
        return [
            {
                k.replace("crash_after_step_2", "distinct_tokens"): v
                for k, v in e.items()
                if not k.startswith(("time/", "step_time", "train_"))
            }
            for e in history
        ]

    assert untimed(full.state.log_history) == untimed(resumed.state.log_history)
    # metrics.jsonl: the crashed run's step-3 entry was dropped on resume, so each step appears once
    assert [json.loads(line)["step"] for line in open(tmp_path / "b" / "out" / "metrics.jsonl")] == [1, 2, 3, 4, 4]


def _scripted(tokenizer):
    eos = tokenizer.eos_token_id

    def script(prompt_ids, sample):  # different lengths per sample, some without EOS
        body = [(prompt_ids[-1] + 7 * sample + k) % 200 + 3 for k in range(1 + (sample * 3 + len(prompt_ids)) % 6)]
        return body + ([eos] if sample % 3 else [])

    return ScriptedBackend(script, eos, tokenizer)


def _one_step(model_dir, tmp_path, loss_type, **batching):
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = make_config(
        tmp_path,
        max_steps=1,
        num_generations=4,
        loss_type=loss_type,
        bf16=False,
        gradient_checkpointing=False,
        max_grad_norm=0,
        lr_scheduler_type="constant",
        **batching,
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    sgd = torch.optim.SGD(
        model.parameters(), lr=1.0
    )  # update = gradient: compares gradients, not Adam's sign-like steps
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=prompts(),
        processing_class=tokenizer,
        optimizers=(sgd, None),
        generation_backend=_scripted(tokenizer),
    )
    trainer.train()
    return parameters(trainer.model), trainer


@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo"])
def test_gradient_accumulation_invariance(tiny_model_dir, tmp_path, loss_type):
    """One step on 8 completions == 2 accumulated micro-batches of 4 on the same completions."""
    whole, _ = _one_step(tiny_model_dir, tmp_path / "a", loss_type, per_device_train_batch_size=8)
    split, trainer = _one_step(
        tiny_model_dir, tmp_path / "b", loss_type, per_device_train_batch_size=4, gradient_accumulation_steps=2
    )
    assert trainer.plan.steps_per_generation == 2
    base = parameters(AutoModelForCausalLM.from_pretrained(tiny_model_dir))
    assert max_difference(whole, base) > 1e-4  # the step did something
    assert max_difference(whole, split) < 1e-6


def test_mask_truncated_completions_train_only_finished(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    config = make_config(tmp_path, max_steps=1, mask_truncated_completions=True, bf16=False)
    never_ends = ScriptedBackend(lambda ids, s: [5 + s] * 8, tokenizer.eos_token_id, tokenizer)
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=prompts(),
        generation_backend=never_ends,
    )
    before = parameters(trainer.model)
    trainer.train()
    assert max_difference(before, parameters(trainer.model)) == 0.0  # every completion truncated: nothing to learn from
    assert trainer.state.log_history[0]["completions/clipped_ratio"] == 1.0


def test_tokenizer_without_pad_token_falls_back_to_eos(tiny_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.pad_token = None
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path, max_steps=1),
        train_dataset=prompts(),
        processing_class=tokenizer,
    )
    assert tokenizer.pad_token == tokenizer.eos_token
    trainer.train()


# ---- bad input: clear messages, raised before any model is loaded where possible ----------------

MISSING_MODEL = "/nonexistent/model"  # reaching the model loader would raise OSError instead


@pytest.mark.parametrize(
    "dataset,match",
    [
        (datasets.Dataset.from_dict({"prompt": []}), "train_dataset is empty"),
        (datasets.Dataset.from_dict({"question": ["1+1="]}), "no 'prompt' column"),
        (datasets.Dataset.from_dict({"prompt": [[{"text": "hi"}]]}), "Row 0: message 0"),
        (None, "`train_dataset` is required unless an `environment_factory` is provided"),  # TRL's words
    ],
)
def test_bad_dataset_fails_before_model_load(tmp_path, dataset, match):
    with pytest.raises(ValueError, match=match):
        GRPOTrainer(
            model=MISSING_MODEL, reward_funcs=distinct_tokens, args=make_config(tmp_path), train_dataset=dataset
        )


def test_indivisible_batch_fails_before_model_load(tmp_path):
    with pytest.raises(ValueError, match="must be divisible by num_generations=4"):
        GRPOTrainer(
            model=MISSING_MODEL,
            reward_funcs=distinct_tokens,
            args=make_config(tmp_path, num_generations=4),
            train_dataset=prompts(),
        )


def test_num_generations_below_two(tmp_path):
    with pytest.raises(ValueError, match="at least 2 completions per prompt"):
        make_config(tmp_path, num_generations=1)


def test_reward_weights_length_mismatch(tmp_path):
    with pytest.raises(ValueError, match="reward_weights has 2 weights but there are 1"):
        GRPOTrainer(
            model=MISSING_MODEL,
            reward_funcs=distinct_tokens,
            args=make_config(tmp_path, reward_weights=[1.0, 2.0]),
            train_dataset=prompts(),
        )


def test_iterable_dataset_needs_max_steps(tmp_path):
    with pytest.raises(ValueError, match="max_steps must be set"):
        GRPOTrainer(
            model=MISSING_MODEL,
            reward_funcs=distinct_tokens,
            args=make_config(tmp_path, max_steps=-1),
            train_dataset=prompts().to_iterable_dataset(),
        )


def test_iterable_dataset_trains(tiny_model_dir, tmp_path):
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path, max_steps=2),
        train_dataset=prompts().to_iterable_dataset(),
    )
    trainer.train()
    assert trainer.state.global_step == 2


@pytest.mark.parametrize(
    "reward,match",
    [
        (lambda completions, **k: [1.0], r"returned 1 values for 6 completions"),
        (lambda completions, **k: ["high"] * len(completions), r"returned 'high' \(str\) for row 0"),
        (lambda completions, **k: [float("nan")] * len(completions), "returned nan for row 0"),
        (
            lambda completions, **k: [1e39] * len(completions),
            "returned 1e\\+39 for row 0.*finite float32",
        ),  # inf once stored as float32
        (lambda completions, **k: [1 / 0 for _ in completions], "raised ZeroDivisionError.*row 0"),
    ],
)
def test_bad_rewards_name_function_and_row(tiny_model_dir, tmp_path, reward, match):
    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=reward, args=make_config(tmp_path), train_dataset=prompts()
    )
    with pytest.raises(RewardFunctionError, match="'<lambda>' " + match):
        trainer.train()


def test_a_reward_that_hangs_stops_at_reward_timeout_with_the_last_step_saved(tiny_model_dir, tmp_path):
    import threading

    release = threading.Event()

    def judge(completion_ids, trainer_state, **kwargs):
        if trainer_state.global_step >= 2:  # step 3's judge never answers
            release.wait(60)
        return distinct_tokens(completion_ids)

    config = make_config(tmp_path, max_steps=4, reward_timeout=0.5)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=judge, args=config, train_dataset=prompts())
    try:
        with pytest.raises(RewardFunctionError, match=r"'judge' did not return within reward_timeout=0.5 s") as err:
            trainer.train()
    finally:
        release.set()
    assert "The last good state (after step 2) is saved" in str(err.value)
    assert os.path.exists(os.path.join(config.output_dir, "checkpoint-2", "checkpoint_complete"))


def test_prompt_longer_than_context_is_an_error_before_training(tiny_model_dir, tmp_path):
    """Every prompt of a Dataset is tokenized when the trainer is built: the long one is named before any step."""
    rows = datasets.Dataset.from_dict({"prompt": ["1+1="] * 5 + ["1+1=" * 40] + ["1+1="] * 6})
    with pytest.raises(DataRowError, match=r"^train_dataset: Row 5: the prompt is \d+ tokens.*maximum length of 128"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=distinct_tokens, args=make_config(tmp_path), train_dataset=rows)


def test_a_bad_row_found_mid_run_saves_the_last_step_and_names_the_row(tiny_model_dir, tmp_path):
    """A stream's rows are checked as drawn: row 4 (drawn for step 3) is too long; steps 1-2 are kept in checkpoint-2,
    and the error names the row and says how to resume, as a reward error does."""
    good = [f"{i}+1=" for i in range(12)]
    rows = good[:4] + ["1+1=" * 40] + good[4:]
    stream = datasets.Dataset.from_dict({"prompt": rows}).to_iterable_dataset()
    config = make_config(tmp_path, max_steps=6, shuffle_dataset=False)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=stream)
    with pytest.raises(DataRowError, match=r"Row 4: the prompt is \d+ tokens") as stopped:
        trainer.train()
    assert trainer.state.global_step == 2
    assert "resume_from_checkpoint=True" in str(stopped.value)
    checkpoint = os.path.join(config.output_dir, "checkpoint-2")
    assert os.path.exists(os.path.join(checkpoint, "checkpoint_complete"))


def test_a_chat_template_that_fails_on_a_row_names_the_row(tiny_model_dir, tmp_path):
    """Content None in a message (a template that concatenates it fails): the row and the message are named, when
    the trainer is built, not as a raw jinja2 error mid-run."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    conversations = [[{"role": "user", "content": f"{i}+1="}] for i in range(12)]
    conversations[7] = [{"role": "system", "content": "add"}, {"role": "user", "content": None}]
    with pytest.raises(DataRowError, match=r"Row 7: the chat template failed .*Message 1 of 'prompt' has content None"):
        GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=distinct_tokens,
            args=make_config(tmp_path),
            train_dataset=datasets.Dataset.from_dict({"prompt": conversations}),
            processing_class=tokenizer,
        )


def test_generation_buffer_serves_spg_times_iterations_micro_steps(tiny_model_dir, tmp_path):
    """TRL's schedule: GA=3, spg=4, mu=2 -> each generation (6 prompts x 4) feeds 8 micro-steps, in order."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    backend = _scripted(tokenizer)
    config = make_config(
        tmp_path,
        per_device_train_batch_size=6,
        num_generations=4,
        gradient_accumulation_steps=3,
        steps_per_generation=4,
        num_iterations=2,
        max_steps=8,
        shuffle_dataset=False,
        learning_rate=1e-3,
    )
    data = datasets.Dataset.from_dict({"prompt": [f"q{i}=" for i in range(18)]})
    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=data, generation_backend=backend
    )
    assert trainer.plan.old_logprobs_needed
    trainer.train()
    # 8 optimizer steps x 3 micro-steps = 24 micro-steps = 3 generations of 8 micro-steps each
    assert len(backend.calls) == 3
    decoded = [[tokenizer.decode(p) for p in prompts] for prompts, n in backend.calls]
    assert decoded == [[f"q{i}=" for i in range(6 * g, 6 * g + 6)] for g in range(3)]
    assert all(n == 4 for _, n in backend.calls)


def test_num_iterations_trains_off_policy(tiny_model_dir, tmp_path):
    """With mu=2 the second pass sees ratios != 1: clipping fires somewhere with a large step size."""
    config = make_config(tmp_path, num_iterations=2, max_steps=4, learning_rate=0.05, epsilon=0.05)
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=prompts())
    trainer.train()
    regions = [e["clip_ratio/region_mean"] for e in trainer.state.log_history if "clip_ratio/region_mean" in e]
    assert max(regions) > 0.0


def test_default_bf16_declined_on_cpu_without_bf16_units(tiny_model_dir, tmp_path, monkeypatch, caplog):
    import grouprl.compat.accelerator_setup as accelerator_setup
    import grouprl.compat.trainer as trainer_module

    """On any machine: use_cpu=True makes it a CPU run, and the CPU is made one that emulates bf16."""
    reason = "this CPU has no bf16 units (no AVX512-BF16/AMX)"
    monkeypatch.setattr(accelerator_setup, "bf16_emulation_reason", lambda: reason)  # the precision decision
    monkeypatch.setattr(trainer_module, "native_bf16", lambda: False)  # quantized layers' dtype
    config = make_config(tmp_path, max_steps=1, use_cpu=True)  # bf16 left at TRL's default (True)
    assert config.bf16 and config.bf16_from_default
    trainer = GRPOTrainer(model=tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=prompts())
    assert trainer.accelerator.mixed_precision == "no"
    assert "training in fp32" in caplog.text and reason in caplog.text
    explicit = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=make_config(tmp_path, max_steps=1, bf16=True, use_cpu=True),
        train_dataset=prompts(),
    )
    assert explicit.accelerator.mixed_precision == "bf16"
    assert "expect steps ~100x slower" in caplog.text


def test_batch_plan_is_logged_at_info_not_warning(tiny_model_dir, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="grouprl"):
        GRPOTrainer(
            model=tiny_model_dir, reward_funcs=distinct_tokens, args=make_config(tmp_path), train_dataset=prompts()
        )
    (record,) = [r for r in caplog.records if "grouprl batch plan" in r.getMessage()]
    assert record.levelno == logging.INFO and "epoch: 12 prompts -> 6 optimizer steps" in record.getMessage()


def test_log_level_replica_applies_off_the_main_process(monkeypatch):
    from grouprl.train.log_level import apply_log_level

    grouprl_logger = logging.getLogger("grouprl")
    before = grouprl_logger.level
    config = GRPOConfig(log_level="info", log_level_replica="error")
    try:
        apply_log_level(config)
        assert grouprl_logger.getEffectiveLevel() == logging.INFO
        monkeypatch.setattr(GRPOConfig, "should_log", property(lambda self: False))  # as on a replica process
        apply_log_level(config)
        assert grouprl_logger.getEffectiveLevel() == logging.ERROR
    finally:
        grouprl_logger.setLevel(before)
        logging.getLogger("transformers").setLevel(logging.WARNING)


def test_all_rewards_none_warns_in_trl_words_during_training(tiny_model_dir, tmp_path, caplog):
    def always_none(completions, **kwargs):
        return [None] * len(completions)

    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=always_none, args=make_config(tmp_path, max_steps=1), train_dataset=prompts()
    )
    with caplog.at_level("WARNING", logger="trl.trainer.grpo_trainer"):  # as TRL's test_warning_raised_all_rewards_none
        trainer.train()
    assert "All reward functions returned None for the following kwargs:" in caplog.text
    assert "6 of 6 completions got no reward" in caplog.text


@pytest.mark.e2e
def test_dataloader_workers_read_the_prompts_and_change_nothing_else(tiny_model_dir, tmp_path):
    """TRL's test_train_multiple_dataloader_workers; workers must not change which prompts come when, nor the RNG."""
    runs = {}
    readers = {
        "none": {},
        "two": {"dataloader_num_workers": 2},
        "persistent": {
            "dataloader_num_workers": 2,
            "dataloader_persistent_workers": True,
            "dataloader_prefetch_factor": 1,
            "dataloader_multiprocessing_context": "fork",
        },
    }
    for name, settings in readers.items():
        trainer = GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=distinct_tokens,
            train_dataset=prompts(),
            args=make_config(tmp_path / name, max_steps=7, **settings),
        )  # 6 steps per epoch
        loader = trainer.get_train_dataloader().loader
        assert (loader.num_workers, loader.persistent_workers) == (
            settings.get("dataloader_num_workers", 0),
            name == "persistent",
        )
        trainer.train()
        runs[name] = (parameters(trainer.model), trainer.state.log_history)
    for name in ("two", "persistent"):
        assert max_difference(runs["none"][0], runs[name][0]) == 0.0
        assert [e.get("reward") for e in runs["none"][1]] == [e.get("reward") for e in runs[name][1]]
    assert loader.prefetch_factor == 1 and loader.multiprocessing_context.get_start_method() == "fork"


def test_iterable_train_dataset_forces_zero_workers(tmp_path, caplog):
    """TRL's test_iterable_dataset_forces_num_workers_zero (the value is written back, as TRL does)."""
    args = make_config(tmp_path, dataloader_num_workers=4)
    with caplog.at_level(logging.WARNING, logger="grouprl"), pytest.raises(OSError):
        GRPOTrainer(
            model=MISSING_MODEL, reward_funcs=distinct_tokens, args=args, train_dataset=prompts().to_iterable_dataset()
        )
    assert args.dataloader_num_workers == 0 and "dataloader_num_workers=4 is set to 0" in caplog.text
    with pytest.raises(ValueError, match="dataloader_num_workers=-1 must be an integer >= 0"):
        GRPOTrainer(
            model=MISSING_MODEL,
            reward_funcs=distinct_tokens,
            args=make_config(tmp_path, dataloader_num_workers=-1),
            train_dataset=prompts(),
        )


def test_iterable_eval_keeps_map_style_train_workers(tiny_model_dir, tmp_path):
    """TRL's test of the same name: only the stream's loader reads in-process; the setting is not changed."""
    args = make_config(tmp_path, dataloader_num_workers=2, per_device_eval_batch_size=6)
    eval_stream = prompts(4).to_iterable_dataset()
    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=distinct_tokens, args=args, train_dataset=prompts(), eval_dataset=eval_stream
    )
    assert trainer.get_train_dataloader().num_workers == 2
    assert trainer.get_eval_dataloader().num_workers == 0
    assert trainer.get_eval_dataloader(prompts(4)).num_workers == 2
    assert args.dataloader_num_workers == 2
    batches = [[index for index, _ in batch] for batch in trainer.get_eval_dataloader(prompts(5))]
    assert batches == [[0, 1], [2, 3], [4]]  # dataset order, one eval batch of prompts (6 completions / G=3) at a time
    assert trainer.evaluate()["eval_reward"] > 0


def test_persistent_workers_serve_every_evaluation_of_a_dataset(tiny_model_dir, tmp_path):
    args = make_config(
        tmp_path, dataloader_num_workers=2, dataloader_persistent_workers=True, per_device_eval_batch_size=6
    )
    eval_prompts = prompts(4)
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=args,
        train_dataset=prompts(),
        eval_dataset=eval_prompts,
    )
    loader = trainer.get_eval_dataloader()
    assert loader.persistent_workers and trainer.get_eval_dataloader() is loader
    assert trainer.get_eval_dataloader(prompts(4)) is not loader  # another dataset, another loader
    first, second = trainer.evaluate(), trainer.evaluate()
    assert first["eval_reward"] == second["eval_reward"]  # evaluation is seeded: the same prompts, the same samples


def test_an_epochs_leftover_micro_batches_make_a_last_shorter_step(tiny_model_dir, tmp_path):
    """TRL's test_prepare_input_called_with_correct_data, on the tiny model: 17 prompts, 6 per generation, each
    generation fed to 4 x 2 micro-batches -> 16 per epoch. With GA 3 each epoch is 6 optimizer steps, the last
    with the 1 micro-batch left (as transformers' Trainer), so 3 epochs call training_step 48 times (not 45), each
    generation batch 8 times in dataset order, and the loss divides by the step's own micro-batch count."""
    prompts = [f"{i}+{i % 5}=" for i in range(17)]
    seen = []

    class Spy(GRPOTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            seen.append((list(inputs), self.current_gradient_accumulation_steps))
            return super().training_step(model, inputs, num_items_in_batch)

    config = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=6,
        num_generations=4,
        steps_per_generation=4,
        num_iterations=2,
        gradient_accumulation_steps=3,
        num_train_epochs=3,
        max_completion_length=4,
        shuffle_dataset=False,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
    )
    trainer = Spy(
        model=tiny_model_dir,
        reward_funcs=distinct_tokens,
        args=config,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
    )
    trainer.train()
    assert len(seen) == 48 and trainer.state.global_step == 18
    first = [{"prompt": p} for p in prompts[0:6] for _ in range(4)]
    second = [{"prompt": p} for p in prompts[6:12] for _ in range(4)]
    assert all(inputs == first for inputs, _ in seen[0:8]) and all(inputs == second for inputs, _ in seen[8:16])
    assert [ga for _, ga in seen] == ([3] * 15 + [1]) * 3
    assert trainer.state.epoch == pytest.approx(3.0)
