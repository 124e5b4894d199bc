"""What the CPU can run decides grouprl's CPU paths (core/cpu_capabilities.py): bf16 units, oneDNN's bf16 and the
instruction-set limits in force; with the instruction set held to AVX2, bf16=True trains instead of crashing."""

import json
import math
import os
import platform
import subprocess
import sys
import textwrap

import pytest

from grouprl.core import cpu_capabilities

AVX2_HELD = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}


@pytest.fixture
def machine(monkeypatch):
    """Make this process see a chosen CPU: `machine(flags, onednn_bf16)`; every cached answer is asked anew."""

    def make(flags: set[str], onednn_bf16: bool) -> None:
        monkeypatch.setattr(cpu_capabilities, "cpu_flags", lambda: frozenset(flags))
        monkeypatch.setattr(cpu_capabilities, "onednn_runs_bf16", lambda: onednn_bf16)
        cpu_capabilities.bf16_emulation_reason.cache_clear()

    yield make
    cpu_capabilities.bf16_emulation_reason.cache_clear()


def test_bf16_is_native_only_with_units_that_onednn_may_use(machine, monkeypatch):
    for name in cpu_capabilities.ISA_LIMITS:
        monkeypatch.delenv(name, raising=False)
    machine({"avx2", "fma"}, onednn_bf16=False)  # an AVX2-only CPU
    assert cpu_capabilities.bf16_emulation_reason() == "this CPU has no bf16 units (no AVX512-BF16/AMX)"
    machine({"avx2", "avx512f", "avx512bw"}, onednn_bf16=True)  # AVX-512 without bf16 units: oneDNN emulates it
    assert not cpu_capabilities.native_bf16()
    machine({"avx2", "avx512bw", "avx512_bf16"}, onednn_bf16=True)
    assert cpu_capabilities.native_bf16()
    machine({"avx2", "amx_bf16"}, onednn_bf16=False)  # a torch build whose oneDNN cannot use them
    assert "oneDNN in this torch build" in cpu_capabilities.bf16_emulation_reason()


@pytest.mark.parametrize(
    "limit,native",
    [("AVX2", False), ("avx512_core", False), ("AVX512_CORE_BF16", True), ("AVX512_CORE_AMX", True), ("", True)],
)
def test_onednn_held_below_the_bf16_units_emulates_them(machine, monkeypatch, limit, native):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", limit)
    machine({"avx2", "avx512bw", "avx512_bf16"}, onednn_bf16=True)
    assert cpu_capabilities.native_bf16() == native
    if not native:
        assert f"ONEDNN_MAX_CPU_ISA={limit}" in cpu_capabilities.bf16_emulation_reason()


def test_summary_names_the_flags_the_kernels_and_the_limits(machine, monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS", raising=False)
    machine({"avx2", "avx512_bf16", "sse4_2"}, onednn_bf16=False)
    line = cpu_capabilities.summary()
    assert "flags [avx2 avx512_bf16]" in line and "oneDNN bf16 no" in line and "bf16 products emulated" in line
    assert line.endswith("instruction-set limits: ONEDNN_MAX_CPU_ISA=AVX2")


QUICKSTART_BF16 = textwrap.dedent("""
    import json, sys
    from datasets import Dataset
    from grouprl import GRPOConfig, GRPOTrainer

    dataset = Dataset.from_dict({"prompt": ["The sky is", "Once upon a time", "def add(a, b):", "Hello"]})

    def reward_num_unique_chars(completions, **kwargs):
        return [len(set(c)) for c in completions]

    args = GRPOConfig(output_dir="out", bf16=True, max_steps=3, logging_steps=1, log_level="info", report_to="none")
    trainer = GRPOTrainer(model=sys.argv[1], reward_funcs=reward_num_unique_chars, args=args, train_dataset=dataset)
    trainer.train()
    print(json.dumps({"mixed_precision": trainer.accelerator.mixed_precision, "device": str(trainer.accelerator.device),
                      "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e]}))
""")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the limits name x86 instruction sets")
def test_bf16_quickstart_trains_with_the_instruction_set_held_to_avx2(long_context_model_dir, tmp_path):
    """TRL's quick start with bf16=True, 3 steps, on the code paths of an AVX2-only CPU: the instruction set held
    before torch loads (so in a fresh process), on the CPU whatever else the machine has. Before the capability
    checks this crashed in generation ("bf16 path needs the cpu support avx_ne_convert or avx512bw ...")."""
    script = tmp_path / "quickstart_bf16.py"
    script.write_text(QUICKSTART_BF16)
    env = {**os.environ, **AVX2_HELD, "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false"}
    result = subprocess.run(
        [sys.executable, str(script), str(long_context_model_dir)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome["mixed_precision"] == "bf16" and outcome["device"] == "cpu"
    assert len(outcome["losses"]) == 3 and all(math.isfinite(loss) for loss in outcome["losses"])
    log = result.stderr
    assert "bf16 products emulated; instruction-set limits: ATEN_CPU_CAPABILITY=avx2" in log  # the summary line
    assert "bf16=True where bf16 products are emulated (" in log
    assert "bf16 decode products on the CPU use F.linear, not packed weights" in log  # the path chosen, and why
