"""grouprl train --accelerate_config: the accelerate launch command line it builds, and the bundled configs."""

import sys

import pytest
from accelerate.commands.config.config_args import load_config_from_file

from grouprl.cli import main
from grouprl.launch import bundled_configs, launch_command, resolve_accelerate_config


def test_bundled_configs_are_valid_accelerate_configs():
    assert set(bundled_configs()) >= {"single_gpu", "multi_gpu", "zero2", "zero3", "fsdp2"}
    kinds = {
        name: str(load_config_from_file(resolve_accelerate_config(name)).distributed_type) for name in bundled_configs()
    }
    assert (
        kinds["single_gpu"].endswith("NO")
        and kinds["multi_gpu"].endswith("MULTI_GPU")
        and kinds["fsdp2"].endswith("FSDP")
    )
    assert all(kinds[f"zero{stage}"].endswith("DEEPSPEED") for stage in (1, 2, 3))
    assert load_config_from_file(resolve_accelerate_config("zero3")).deepspeed_config["zero_stage"] == 3
    assert load_config_from_file(resolve_accelerate_config("fsdp2")).fsdp_config["fsdp_version"] == 2


def test_unknown_flags_go_to_accelerate_launch_in_order(tmp_path):
    argv = [
        "--accelerate_config",
        "zero3",
        "--model_name_or_path",
        "m",
        "--num_processes",
        "16",
        "--max_steps",
        "16",
        "--num_machines",
        "2",
        "--machine_rank",
        "1",
        "--main_process_ip",
        "10.0.0.1",
        "--main_process_port",
        "29500",
        "--learning-rate",
        "1e-5",
        "--config",
        "run.yaml",
        "--reward_funcs",
        "accuracy_reward",
        "think_format_reward",
    ]
    assert launch_command(argv) == [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        resolve_accelerate_config("zero3"),
        "--num_processes",
        "16",
        "--num_machines",
        "2",
        "--machine_rank",
        "1",
        "--main_process_ip",
        "10.0.0.1",
        "--main_process_port",
        "29500",
        "-m",
        "grouprl.cli",
        "train",
        "--model_name_or_path",
        "m",
        "--max_steps",
        "16",
        "--learning-rate",
        "1e-5",
        "--config",
        "run.yaml",
        "--reward_funcs",
        "accuracy_reward",
        "think_format_reward",
    ]
    own = tmp_path / "mine.yaml"
    own.write_text("distributed_type: MULTI_GPU\nnum_processes: 2\n")
    assert launch_command(["--accelerate-config", str(own), "--max_steps", "1"])[4] == str(own)
    assert launch_command(["--max_steps", "1"]) is None  # no --accelerate_config: train in this process


def test_unknown_config_name_lists_the_bundled_ones():
    with pytest.raises(ValueError, match="neither a bundled config .*multi_gpu.*zero3"):
        launch_command(["--accelerate_config", "zero9", "--max_steps", "1"])


def test_serve_help():
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0


def test_sharding_asked_for_on_a_cpu_launch_is_run_or_named_as_ddp(monkeypatch):
    """accelerate turns a multi-process CPU launch into DDP (MULTI_CPU) even under an FSDP or DeepSpeed config:
    grouprl switches FSDP2 on (test_distributed.py runs it) and names what it cannot switch on instead of letting
    it pass as sharded."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from grouprl.compat.accelerator_setup import fsdp2_asked_on_cpu, sharding_asked_but_not_run

    cpu_launch = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU)
    sharded = SimpleNamespace(distributed_type=DistributedType.FSDP)
    plain = SimpleNamespace(fsdp_plugin_args=None, deepspeed_plugin=None)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch --config_file fsdp2.yaml` sets
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert fsdp2_asked_on_cpu(cpu_launch, plain) and not fsdp2_asked_on_cpu(sharded, plain)
    monkeypatch.setenv("FSDP_VERSION", "1")
    assert not fsdp2_asked_on_cpu(cpu_launch, plain)
    assert sharding_asked_but_not_run(cpu_launch, plain) == "FSDP version 1"
    assert sharding_asked_but_not_run(sharded, plain) is None
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    assert sharding_asked_but_not_run(cpu_launch, plain) is None  # plain DDP was asked for
    assert fsdp2_asked_on_cpu(cpu_launch, SimpleNamespace(fsdp_plugin_args={"fsdp_version": 2}))
    deepspeed = SimpleNamespace(fsdp_plugin_args=None, deepspeed_plugin=object())
    assert sharding_asked_but_not_run(cpu_launch, deepspeed) == "DeepSpeed"
