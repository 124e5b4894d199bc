"""Shared fixtures: tiny locally built models (no hub access) and a scripted generation backend."""

import contextlib
import os
import socket
import subprocess
import sys

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: skipped, with the reason, where there is none."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="marked gpu: needs a CUDA device, and this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random ~90k-parameter Qwen2 with the demo tokenizer (byte-level BPE, ChatML template)."""
    from grouprl.demo.model import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def long_context_model_dir(tmp_path_factory):
    """The same tiny model with room for TRL's default max_completion_length (512)."""
    from grouprl.demo.model import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny_long") / "model", seed=0, max_position_embeddings=1024)


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory):
    """The same tiny model with room for tool schemas in the prompt, and a chat template that renders tools."""
    from transformers import AutoTokenizer

    from grouprl.demo.model import save_tiny_model
    from grouprl.demo.tokenizer import TOOL_CHAT_TEMPLATE

    path = save_tiny_model(tmp_path_factory.mktemp("tools") / "model", seed=0, max_position_embeddings=1024)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def qwen2_vl_model_dir(tmp_path_factory):
    """The tiny Qwen2-VL of tests/vlm_models.py, saved (for processes that load rather than build it)."""
    from vlm_models import save_tiny_qwen2_vl

    return save_tiny_qwen2_vl(tmp_path_factory.mktemp("qwen2_vl") / "model")


@pytest.fixture(scope="session")
def qwen2_vl_server(qwen2_vl_model_dir):
    """`grouprl serve` of the saved tiny Qwen2-VL in a subprocess: (base url, process)."""
    with serving(qwen2_vl_model_dir) as started:
        yield started


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory):
    """A random tiny Qwen2ForSequenceClassification (num_labels=1) with the demo tokenizer, saved as "tiny-rm"."""
    import torch
    from transformers import Qwen2ForSequenceClassification

    from grouprl.demo.model import tiny_qwen2_config
    from grouprl.demo.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    config = tiny_qwen2_config(tokenizer, hidden_size=32, num_hidden_layers=1, intermediate_size=64)
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        model = Qwen2ForSequenceClassification(config)
    path = tmp_path_factory.mktemp("rm") / "tiny-rm"
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="session")
def grouprl_server(tiny_model_dir):
    """`grouprl serve` of the tiny model in a subprocess: (base url, process). test_server.py's last test kills it."""
    with serving(tiny_model_dir) as started:
        yield started


@contextlib.contextmanager
def serving(model_dir, *flags):
    """`grouprl serve --model model_dir [flags]` in a subprocess, once it answers: (base url, process); killed
    after."""
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    from grouprl.generation.remote import RemoteGenerator, ServerError

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "grouprl.cli",
            "serve",
            "--model",
            str(model_dir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *flags,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        RemoteGenerator(url, timeout=120)  # waits for /health
    except ServerError:
        process.kill()
        raise AssertionError(process.stdout.read().decode()[-3000:]) from None
    try:
        yield url, process
    finally:  # also when the test fails inside the block: no server is left running
        process.kill()
        process.wait()
