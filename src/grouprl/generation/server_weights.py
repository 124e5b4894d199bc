"""How weights reach a served model: named tensors loaded in place, from an HTTP body or by broadcast.

Broadcasts run over a 2-process group of the trainer's main process (rank 0) and the server (rank 1),
separate from the training group; both sides build it with `new_pair_group`.
"""

from datetime import timedelta
from typing import Any

import torch


class WeightReceiver:
    """Loads named tensors into the served model; counts updates (weight_version)."""

    def __init__(self, model: torch.nn.Module, version: int = 0):
        self.model = model
        self.params = dict(model.named_parameters())
        self.version = version
        self.group: Any = None  # torch.distributed process group shared with the trainer (broadcast mode)
        self.backend = "gloo"

    @torch.no_grad()
    def load(self, tensors: dict[str, torch.Tensor]) -> int:
        unknown = sorted(set(tensors) - set(self.params))
        if unknown:
            raise ValueError(
                f"unknown weight names {unknown[:5]}{' ...' if len(unknown) > 5 else ''}: the trainer's model does not "
                "match the served model (serve the same architecture, e.g. the checkpoint the trainer started from)."
            )
        for name, tensor in tensors.items():
            param = self.params[name]
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(
                    f"weight {name}: shape {tuple(tensor.shape)} from the trainer, {tuple(param.shape)} on the server."
                )
            param.copy_(tensor.to(device=param.device, dtype=param.dtype))
        return len(tensors)

    def advance(self, version: Any = None) -> None:
        """An update is complete: its version is the one the trainer named (the policy's step), else the next."""
        self.version = self.version + 1 if version is None else int(version)

    def join_group(self, host: str, port: int, backend: str, timeout: float) -> None:
        """Join the trainer's 2-process group as rank 1 (the trainer process is rank 0 and hosts the store)."""
        store = torch.distributed.TCPStore(host, port, 2, is_master=False, timeout=timedelta(seconds=timeout))
        self.group, self.backend = new_pair_group(store, rank=1, backend=backend, timeout=timeout), backend

    @torch.no_grad()
    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]]) -> int:
        if self.group is None:
            raise ValueError("no weight broadcast group: POST /init_weight_broadcast first.")
        device = next(self.model.parameters()).device if self.backend == "nccl" else torch.device("cpu")
        received = {}
        for name, dtype, shape in zip(names, dtypes, shapes):
            tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            self.group.broadcast(tensor, 0).wait()
            received[name] = tensor
        return self.load(received)


def new_pair_group(store: Any, *, rank: int, backend: str, timeout: float) -> Any:
    """A process group of the trainer's main process and the server, separate from the training group."""
    if backend == "gloo":
        return torch.distributed.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout))
    if backend == "nccl":
        options = torch.distributed.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=timeout)
        return torch.distributed.ProcessGroupNCCL(store, rank, 2, options)
    raise ValueError(f"weight broadcast backend {backend!r}: use 'gloo' or 'nccl'.")
