"""The grouprl command line: help, a real train run from flags and from YAML, reward resolution."""

import json
import os
import subprocess
import sys

import datasets
import pytest
import yaml

from grouprl.cli import main
from grouprl.cli.train_arguments import parse_train_args
from grouprl.cli.train_inputs import resolve_reward_function
from grouprl.demo.task import arithmetic_reward
from grouprl.rewards import BUILTIN_REWARDS, accuracy_reward


def test_help_exits_cleanly():
    result = subprocess.run([sys.executable, "-m", "grouprl.cli", "train", "--help"], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    for flag in ("--num_generations", "--loss_type", "--reward_funcs", "--model_name_or_path", "--dataset_name"):
        assert flag in result.stdout
    assert main(["--help"]) == 0


def modules_imported(statement: str, names: tuple[str, ...]) -> list[str]:
    """Which of `names` a fresh Python process has imported after running `statement`."""
    check = f"import json, sys\n{statement}\nprint(json.dumps([n for n in {names!r} if n in sys.modules]))"
    result = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])  # the last line: `statement` may print before it


def test_each_part_imports_only_what_it_uses():
    """`grouprl --help` and `grouprl serve --help` import neither torch nor transformers; the generation server
    (each `grouprl serve` worker of an async run) does not import the trainer, transformers' Trainer or peft;
    `from grouprl import ...` still gives every public name (grouprl/__init__.py, on first use)."""
    heavy = ("torch", "transformers")
    assert modules_imported("import grouprl.cli\ngrouprl.cli.main(['--help'])", heavy) == []
    serve_help = "import grouprl.cli\ntry:\n    grouprl.cli.main(['serve', '--help'])\nexcept SystemExit:\n    pass"
    assert modules_imported(serve_help, heavy) == []
    trainer = ("grouprl.compat.trainer", "transformers.trainer", "peft")
    assert modules_imported("import grouprl.generation.server", trainer) == []
    import grouprl

    for name in grouprl.__all__:
        assert getattr(grouprl, name) is not None
    with pytest.raises(AttributeError, match="no attribute 'GRPOTrainr'"):
        getattr(grouprl, "GRPOTrainr")  # noqa: B009 (the name is misspelled on purpose)


def test_reward_resolution(tmp_path, monkeypatch):
    assert resolve_reward_function("arithmetic_reward") is arithmetic_reward
    (tmp_path / "my_rewards.py").write_text("def shout(completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    assert resolve_reward_function("my_rewards.shout").__name__ == "shout"
    with pytest.raises(ValueError, match="not a built-in reward"):
        resolve_reward_function("nonsense")
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        resolve_reward_function("my_rewards.missing")
    with pytest.raises(ValueError, match=r"has no attribute 'shuot'\. Did you mean my_rewards\.shout\?"):
        resolve_reward_function("my_rewards.shuot")
    with pytest.raises(ValueError, match=r"Did you mean accuracy_reward\?"):
        resolve_reward_function("acuracy_reward")


def test_user_errors_of_every_command_are_two_lines(tmp_path, monkeypatch, capsys):
    """A mistyped model path (serve, demo), a bad value (demo), an old TRL field: the message alone, no traceback."""
    monkeypatch.chdir(tmp_path)
    for command in (["serve", "--model", "./no-such-model"], ["demo", "--model", "./nope", "--max_steps", "1"]):
        assert main(command) == 1
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 2 and f"grouprl {command[0]}: OSError: The model path '{command[2]}' looks like a" in err[0]
        assert "repo id" not in err[0].lower() and "GROUPRL_TRACEBACK=1" in err[1]
    with pytest.raises(SystemExit) as caught:
        main(["demo", "--max_steps", "-3"])
    assert caught.value.code == 2
    assert "argument --max_steps: -3 is too small: it must be at least 1" in capsys.readouterr().err
    from grouprl import GRPOConfig

    with pytest.raises(TypeError, match="has no field 'max_prompt_length': TRL 1.16's GRPOConfig has no"):
        GRPOConfig(max_prompt_length=256)


def test_lora_all_linear_is_peft_keyword():
    from grouprl.cli.train_inputs import lora_config

    _, _, model = parse_train_args(["--use_peft", "--lora_target_modules", "all-linear"])
    assert lora_config(model).target_modules == "all-linear"
    _, _, model = parse_train_args(["--use_peft", "--lora_target_modules", "q_proj", "v_proj"])
    assert lora_config(model).target_modules == {"q_proj", "v_proj"}


def test_builtin_reward_names_as_trl_cli(tmp_path):
    from grouprl.config.grpo_config import GRPOConfig

    assert resolve_reward_function("accuracy_reward") is accuracy_reward
    for name in ("reasoning_accuracy_reward", "think_format_reward"):
        assert resolve_reward_function(name).__name__ == name
    overlong = resolve_reward_function("get_soft_overlong_punishment")
    assert (overlong.max_completion_len, overlong.soft_punish_cache) == (1280, 256)  # as trl grpo
    cosine = resolve_reward_function(
        "get_cosine_scaled_reward", GRPOConfig(output_dir=str(tmp_path), max_completion_length=64)
    )
    assert cosine.max_len == 64 and cosine.__name__ == "cosine_scaled_reward"
    assert resolve_reward_function("get_repetition_penalty_reward").ngram_size == 3
    assert set(BUILTIN_REWARDS) >= {
        "accuracy_reward",
        "reasoning_accuracy_reward",
        "think_format_reward",
        "get_soft_overlong_punishment",
    }


def test_train_command_with_reward_model_and_eval_split(tiny_model_dir, tiny_reward_model_dir, tmp_path):
    rows = {"prompt": [f"{i}+1=" for i in range(8)]}
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict(rows), "test": datasets.Dataset.from_dict({"prompt": ["9+1=", "8+2="]})}
    ).save_to_disk(str(tmp_path / "data"))
    out = tmp_path / "out"
    code = main(
        [
            "train",
            "--model_name_or_path",
            tiny_model_dir,
            "--dataset_name",
            str(tmp_path / "data"),
            "--reward_model_name_or_path",
            tiny_reward_model_dir,
            "--reward_funcs",
            "get_repetition_penalty_reward",
            "--eval_strategy",
            "steps",
            "--eval_steps",
            "1",
            "--per_device_eval_batch_size",
            "4",
            "--output_dir",
            str(out),
            "--num_generations",
            "4",
            "--per_device_train_batch_size",
            "4",
            "--max_completion_length",
            "6",
            "--max_steps",
            "1",
            "--logging_steps",
            "1",
            "--save_strategy",
            "no",
            "--disable_tqdm",
            "true",
            "--report_to",
            "none",
        ]
    )
    assert code == 0
    lines = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert "rewards/tiny-rm/mean" in lines[0] and "rewards/repetition_penalty_reward/mean" in lines[0]
    assert "eval_rewards/tiny-rm/mean" in lines[1]


def test_yaml_sets_defaults_and_flags_override(tmp_path):
    config_file = tmp_path / "run.yaml"
    config_file.write_text(
        yaml.safe_dump({"num_generations": 4, "learning_rate": 0.5, "env": {"GROUPRL_TEST_ENV": "on"}})
    )
    script, config, model = parse_train_args(
        ["--config", str(config_file), "--learning_rate", "0.25", "--model_name_or_path", "m"]
    )
    assert (config.num_generations, config.learning_rate, model.model_name_or_path) == (4, 0.25, "m")
    assert os.environ.pop("GROUPRL_TEST_ENV") == "on"
    config_file.write_text(yaml.safe_dump({"num_generation": 4}))
    with pytest.raises(ValueError, match=r"unknown key 'num_generation' \(did you mean num_generations\?\)\. Every"):
        parse_train_args(["--config", str(config_file)])
    config_file.write_text(yaml.safe_dump({"num_generation": 4, "lerning_rate": 1e-6, "zzz": 1}))
    with pytest.raises(ValueError) as every:  # every unknown key at once
        parse_train_args(["--config", str(config_file)])
    assert (
        "unknown keys 'lerning_rate' (did you mean learning_rate?), 'num_generation' (did you mean num_generations?), "
        "'zzz'. Every key" in str(every.value)
    )


def test_train_command_end_to_end(tiny_model_dir, tmp_path):
    data = tmp_path / "train.jsonl"
    datasets.Dataset.from_dict(
        {"prompt": [f"{i}+1=" for i in range(8)], "answer": [str(i + 1) for i in range(8)]}
    ).to_json(str(data))
    out = tmp_path / "out"
    code = main(
        [
            "train",
            "--model_name_or_path",
            tiny_model_dir,
            "--dataset_name",
            str(data),
            "--reward_funcs",
            "arithmetic_reward",
            "--output_dir",
            str(out),
            "--num_generations",
            "4",
            "--per_device_train_batch_size",
            "4",
            "--max_completion_length",
            "6",
            "--max_steps",
            "2",
            "--logging_steps",
            "1",
            "--save_strategy",
            "no",
            "--disable_tqdm",
            "true",
            "--report_to",
            "none",
        ]
    )
    assert code == 0
    assert os.path.exists(out / "model.safetensors") and os.path.exists(out / "tokenizer.json")
    lines = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert "rewards/arithmetic_reward/mean" in lines[0] and lines[-1]["step"] == 2


def test_train_command_with_lora_flags_and_callbacks(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """trl grpo's LoRA flags build the adapter; --callbacks imports TrainerCallbacks by dotted path."""
    (tmp_path / "my_callbacks.py").write_text(
        "from transformers import TrainerCallback\n"
        "class StepFile(TrainerCallback):\n"
        "    def on_step_end(self, args, state, control, **kwargs):\n"
        "        open(args.output_dir + '/steps.txt', 'a').write(f'{state.global_step}\\n')\n"
    )
    monkeypatch.chdir(tmp_path)
    data = tmp_path / "train.jsonl"
    datasets.Dataset.from_dict(
        {"prompt": [f"{i}+1=" for i in range(8)], "answer": [str(i + 1) for i in range(8)]}
    ).to_json(str(data))
    out = tmp_path / "out"
    code = main(
        [
            "train",
            "--model_name_or_path",
            tiny_model_dir,
            "--dataset_name",
            str(data),
            "--reward_funcs",
            "arithmetic_reward",
            "--use_peft",
            "--lora_r",
            "4",
            "--lora_alpha",
            "8",
            "--lora_target_modules",
            "q_proj",
            "v_proj",
            "--callbacks",
            "my_callbacks.StepFile",
            "--output_dir",
            str(out),
            "--num_generations",
            "4",
            "--per_device_train_batch_size",
            "4",
            "--max_completion_length",
            "6",
            "--max_steps",
            "2",
            "--logging_steps",
            "1",
            "--save_strategy",
            "no",
            "--disable_tqdm",
            "true",
            "--report_to",
            "none",
        ]
    )
    assert code == 0
    adapter = json.load(open(out / "adapter_config.json"))
    assert (adapter["r"], adapter["lora_alpha"], sorted(adapter["target_modules"])) == (4, 8, ["q_proj", "v_proj"])
    assert not os.path.exists(out / "model.safetensors")  # the adapter only
    assert open(out / "steps.txt").read().split() == ["1", "2"]
    assert (
        main(
            [
                "train",
                "--model_name_or_path",
                tiny_model_dir,
                "--dataset_name",
                str(data),
                "--reward_funcs",
                "arithmetic_reward",
                "--callbacks",
                "my_callbacks.Missing",
                "--output_dir",
                str(out),
            ]
        )
        == 1
    )
    assert (
        "--callbacks my_callbacks.Missing: module 'my_callbacks' has no attribute 'Missing'" in capsys.readouterr().err
    )


def test_a_flag_error_is_printed_first_and_briefly(capsys):
    with pytest.raises(SystemExit) as caught:
        main(["train", "--num_generation", "4"])
    assert caught.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "grouprl train: error: unrecognized argument --num_generation. Did you mean --num_generations?",
        "See `grouprl train --help` for every flag.",
    ]  # not argparse's usage of every flag (hundreds of lines) before it
    with pytest.raises(SystemExit):
        main(["train", "--learning_rate", "fast"])
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "grouprl train: error: argument --learning_rate/--learning-rate: invalid float value: 'fast'"
    assert len(err) == 2


def test_a_missing_dataset_file_is_named_not_looked_up_on_the_hub(tmp_path, monkeypatch, capsys):
    from grouprl.cli.train_arguments import ScriptArguments
    from grouprl.cli.train_inputs import load_train_dataset

    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1="}\n')
    monkeypatch.chdir(tmp_path)
    flags = ["--model_name_or_path", "unused", "--reward_funcs", "accuracy_reward", "--output_dir", "out"]
    assert main(["train", "--dataset_name", "trian.jsonl", *flags]) == 1  # the data is read before the model loads
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("grouprl train: FileNotFoundError: --dataset_name trian.jsonl")
    message = err[0]
    assert f"--dataset_name trian.jsonl: no such file or directory ({tmp_path / 'trian.jsonl'})" in message
    assert "Did you mean train.jsonl?" in message and "Check the path" in message
    with pytest.raises(FileNotFoundError, match=r"--dataset_name ./data/train: no such file or directory"):
        load_train_dataset(ScriptArguments(dataset_name="./data/train"))
    assert len(load_train_dataset(ScriptArguments(dataset_name="train.jsonl"))) == 1


@pytest.mark.parametrize("flags, expected", [(["--bf16"], True), (["--bf16", "false"], False), ([], True)])
def test_an_optional_boolean_flag_alone_means_true(tmp_path, flags, expected):
    """bf16 is Optional[bool] (None: TRL's default, decided per machine); `--bf16` alone means true, as docs/cli.md
    says of every boolean flag, and `--bf16 false` false."""
    base = ["--model_name_or_path", "m", "--dataset_name", "d", "--output_dir", str(tmp_path)]
    _, config, _ = parse_train_args(base + flags)
    assert config.bf16 is expected and config.bf16_from_default is (not flags)
