"""TRL 1.16's own `trl grpo` script, run end to end with only its GRPOConfig/GRPOTrainer imports
switched to grouprl: the drop-in promise, checked on the script TRL users actually run.

TRL is not a dependency of grouprl. The test installs the pinned wheel (``--no-deps``) into a
git-ignored cache folder, takes ``trl/scripts/grpo.py`` from it, rewrites the two import lines, and
runs the result in a subprocess with that folder on PYTHONPATH. The rest of the script stays TRL's:
its argument parser (``TrlParser`` over ``GRPOConfig``), ``get_peft_config``,
``get_quantization_config``, the reward registry, ``save_model`` and, on transformers >= 5.18,
``trainer.end()``.

Each case trains two steps of a tiny local model with LoRA (``--use_peft``), optionally 4-bit
(``--load_in_4bit``), on a local dataset with a length reward (so advantages are non-zero), then
checks what a user would: the script finishes, the adapter it saved loads onto the base model with
``PeftModel.from_pretrained``, and its LoRA B matrices (initialised to zero) moved.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

TRL_VERSION = "1.16.0"
CACHE = Path(os.environ.get("GROUPRL_TEST_CACHE", Path(__file__).parent / ".cache"))

# The only lines a user edits to switch libraries (each must appear exactly once in TRL's script).
IMPORT_SWAPS = [
    (
        "    from trl import GRPOTrainer, get_dataset, get_peft_config, get_quantization_config\n",
        "    from trl import get_dataset, get_peft_config, get_quantization_config\n"
        "    from grouprl import GRPOTrainer\n",
    ),
    (
        "    from trl import DatasetMixtureConfig, GRPOConfig, ModelConfig, TrlParser\n",
        "    from trl import DatasetMixtureConfig, ModelConfig, TrlParser\n    from grouprl import GRPOConfig\n",
    ),
]

LENGTH_REWARD = '''
def length_reward(completions, **kwargs):
    """Longer completions score higher: varied rewards within a group, so the policy gets a gradient."""
    return [float(len(c if isinstance(c, str) else c[0]["content"])) for c in completions]
'''


def trl_install() -> Path:
    """The pinned TRL wheel unpacked into the cache (installed on first use, reused after)."""
    target = CACHE / f"trl-{TRL_VERSION}"
    script = target / "trl" / "scripts" / "grpo.py"
    if script.is_file() and (target / f"trl-{TRL_VERSION}.dist-info").is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    command = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-input",
        "--quiet",
        "--target",
        str(target),
        f"trl=={TRL_VERSION}",
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.skip(f"pip could not fetch trl=={TRL_VERSION} within 300 s (package index unreachable?)")
    if done.returncode != 0 or not script.is_file():
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        pytest.skip(f"pip could not install trl=={TRL_VERSION} (needed only by this test): {' | '.join(tail)}")
    return target


def grouprl_script(trl_dir: Path, destination: Path) -> Path:
    text = (trl_dir / "trl" / "scripts" / "grpo.py").read_text()
    for old, new in IMPORT_SWAPS:
        assert text.count(old) == 1, f"TRL {TRL_VERSION}'s grpo.py no longer has the line {old.strip()!r}"
        text = text.replace(old, new)
    assert "GRPOTrainer(" in text and "trainer.save_model(" in text
    destination.write_text(text)
    return destination


def local_dataset(folder: Path) -> Path:
    folder.mkdir(parents=True)
    prompts = ["Count to three:", "Name a colour:", "Say hello:", "Spell cat:"]
    (folder / "train.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return folder


def run_script(script: Path, trl_dir: Path, workdir: Path, arguments: list[str]) -> subprocess.CompletedProcess:
    source = Path(importlib.util.find_spec("grouprl").origin).parent.parent  # where this run's grouprl lives
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(source), str(trl_dir)]),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "WANDB_DISABLED": "true",
    }
    return subprocess.run(
        [sys.executable, str(script), *arguments], cwd=workdir, env=env, capture_output=True, text=True, timeout=600
    )


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("quantized", [False, True], ids=["lora", "lora-4bit"])
def test_trl_grpo_script_runs_with_grouprl(quantized, tiny_model_dir, tmp_path):
    if quantized and importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("--load_in_4bit needs bitsandbytes, which is not installed (the dev extra provides it)")
    trl_dir = trl_install()
    workdir = tmp_path / "run"
    workdir.mkdir()
    (workdir / "test_rewards_module.py").write_text(LENGTH_REWARD)
    script = grouprl_script(trl_dir, workdir / "grpo.py")
    output_dir = tmp_path / "out"
    arguments = [
        "--model_name_or_path",
        str(tiny_model_dir),
        "--dataset_name",
        str(local_dataset(tmp_path / "data")),
        "--reward_funcs",
        "test_rewards_module.length_reward",
        "--output_dir",
        str(output_dir),
        "--use_peft",
        "--lora_r",
        "4",
        "--lora_alpha",
        "8",
        "--per_device_train_batch_size",
        "4",
        "--num_generations",
        "4",
        "--max_completion_length",
        "8",
        "--max_steps",
        "2",
        "--learning_rate",
        "0.05",
        "--logging_steps",
        "1",
        "--save_strategy",
        "no",
        "--report_to",
        "none",
        "--use_cpu",
        "--seed",
        "0",
    ]
    if quantized:
        arguments += ["--load_in_4bit", "--dtype", "float32"]

    done = run_script(script, trl_dir, workdir, arguments)
    log = (done.stdout + done.stderr)[-6000:]
    assert done.returncode == 0, f"TRL's grpo.py with grouprl exited {done.returncode}:\n{log}"
    assert "Training completed" in done.stdout + done.stderr, log
    assert (output_dir / "adapter_config.json").is_file(), (
        f"no adapter saved in {sorted(p.name for p in output_dir.iterdir())}"
    )

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = PeftModel.from_pretrained(base, str(output_dir))
    lora_b = {name: p for name, p in model.named_parameters() if "lora_B" in name}
    assert lora_b, "the saved adapter holds no LoRA weights"
    assert any(p.abs().max().item() > 0 for p in lora_b.values()), (
        "LoRA B matrices are still zero: training changed nothing"
    )
    config = json.loads((output_dir / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8
