"""The generation worker of asynchronous training: a process of its own holding its own copy of the weights.

`LocalWorker` is a `grouprl serve` subprocess started from the policy: its configuration, tokenizer and
current weights (LoRA adapters merged, plain transformers names) are written to a temporary directory,
the server loads them at the policy's version and samples with `threads` torch threads. It is restarted
from that directory when it dies (the trainer then sends it the latest weights) and stopped, directory
removed, when training ends. `ServerWorker` is a server the user runs (`grouprl serve`, `vllm serve`):
it can be watched but not restarted. Both say who they are in errors (`describe`).
"""

from __future__ import annotations

import copy
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import torch

from grouprl.generation.server_client import ServerClient, free_local_port
from grouprl.generation.weights import inference_weights


class WorkerDied(RuntimeError):
    """The generation worker exited or stopped answering, and could not be (or was already) restarted."""


class ServerWorker:
    """A generation server the trainer did not start: watched through /health, never restarted."""

    restartable = False

    def __init__(self, url: str):
        self.url = url

    def exit_code(self) -> Optional[int]:
        return None  # not our process: only its answers tell whether it lives

    def describe(self) -> str:
        return f"the generation server at {self.url}"

    def restart(self) -> str:
        raise WorkerDied(f"{self.describe()} stopped answering; it was not started by grouprl, so it is not restarted.")

    def kill(self) -> None:
        pass

    def stop(self) -> None:
        pass


class LocalWorker:
    """`grouprl serve` of a copy of the policy in a subprocess on this machine."""

    restartable = True

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any,
        *,
        weights: Optional[dict[str, torch.Tensor]] = None,
        threads: Optional[int],
        log_path: str,
        startup_timeout: float,
        seed: int = 0,
        generation_engine: str = "auto",  # the trainer's: what samples in the worker (grouprl serve's flag)
    ):
        self.threads, self.log_path, self.startup_timeout, self.seed = threads, log_path, startup_timeout, seed
        self.generation_engine = generation_engine
        self.device = next(model.parameters()).device.type  # the worker samples where the trainer trains
        self.directory = tempfile.mkdtemp(prefix="grouprl-worker-")
        self.dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        write_policy(model, tokenizer, self.directory, weights)
        self.process: Optional[subprocess.Popen] = None
        self.port, self.url, self.version = 0, "", 0

    def start(self, version: int) -> str:
        """Start the server with the written weights named `version`; wait until it answers; return its URL."""
        self.version = version
        port = self.port = self.port or free_local_port()  # a restart keeps the address the clients know
        self.url = f"http://127.0.0.1:{port}"
        command = [sys.executable, "-m", "grouprl.cli", "serve", "--model", self.directory, "--host", "127.0.0.1"]
        command += ["--port", str(port), "--dtype", self.dtype, "--device", self.device]
        command += ["--weight_version", str(version), "--parent_pid", str(os.getpid())]
        command += ["--seed", str(self.seed + version)]  # the run's seed, moved on by the version it starts at
        command += ["--generation_engine", self.generation_engine]
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        if self.threads:
            command += ["--threads", str(self.threads)]
            env["OMP_NUM_THREADS"] = str(self.threads)
        # the same grouprl as the trainer's, wherever it was imported from
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = os.pathsep.join([os.path.dirname(package_root), env.get("PYTHONPATH", "")]).rstrip(
            os.pathsep
        )
        os.makedirs(os.path.dirname(os.path.abspath(self.log_path)), exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        self._wait_until_ready()
        return self.url

    def _wait_until_ready(self) -> None:
        client, deadline = ServerClient(self.url), time.monotonic() + self.startup_timeout
        while True:
            code = self.exit_code()
            if code is not None:
                raise WorkerDied(f"{self.describe()} exited with code {code} while starting; {self.log_tail()}")
            try:
                client.health(timeout=2.0)
                return
            except OSError:
                if time.monotonic() > deadline:
                    self.kill()
                    raise WorkerDied(
                        f"{self.describe()} did not answer within vllm_server_timeout={self.startup_timeout:g}s; "
                        f"{self.log_tail()}"
                    ) from None
                time.sleep(0.2)

    def exit_code(self) -> Optional[int]:
        """None while the process runs; its exit code (negative: the signal that ended it) once it has ended."""
        return None if self.process is None else self.process.poll()

    def describe(self) -> str:
        pid = self.process.pid if self.process is not None else "not started"
        return f"the generation worker (`grouprl serve`, pid {pid}, log {self.log_path})"

    def log_tail(self, characters: int = 2000) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(max(os.path.getsize(self.log_path) - characters, 0))
                return "its log ends with:\n" + log.read().decode(errors="replace")
        except OSError:
            return "no log was written"

    def restart(self) -> str:
        """Stop what is left of the process and start a fresh one from the written weights (their version)."""
        self.kill()
        return self.start(self.version)

    def kill(self) -> None:
        """End the process now (a hung worker: its pending requests then fail at once)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self) -> None:
        """End the process (politely first) and remove the weights directory."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.directory, ignore_errors=True)


def policy_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The policy's current (merged) weights in host memory, under plain transformers names, on the main process; {}
    on the others. Every process calls it: gathers of sharded weights are collective."""
    from accelerate import PartialState

    main = PartialState().is_main_process
    return {
        name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in inference_weights(model) if main
    }


def write_policy(
    model: torch.nn.Module, tokenizer: Any, directory: str, weights: Optional[dict[str, torch.Tensor]] = None
) -> None:
    """The policy as `from_pretrained` loads it: its configuration, tokenizer and current weights (`policy_weights`,
    taken here when not given: one process with whole weights)."""
    from safetensors.torch import save_file

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # LoRA: the wrapped model's config
    config = copy.deepcopy(base.config)
    if hasattr(config, "quantization_config"):  # the weights written are full ones (a quantized policy's dequantized)
        del config.quantization_config
    config.save_pretrained(directory)
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    weights = policy_weights(model) if weights is None else weights
    save_file(weights, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
