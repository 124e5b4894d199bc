"""The reference policy pi_ref of the KL penalty (beta != 0), and TR-DPO reference syncing.

Where pi_ref comes from (TRL §3.3):

- a full-parameter policy: a second, frozen model, loaded like the policy from its id / path with
  ``model_init_kwargs``, or, for a model instance, a deep copy taken at start-up (before training
  changes it);
- a LoRA policy: the same model, with its adapters disabled or with the frozen "ref" adapter on
  (`adapters.reference_mode`), so no second copy of the weights is held.

``sync_ref_model`` (TR-DPO, Gorbatovski et al. 2024) mixes the policy into the reference every
``ref_model_sync_steps`` optimizer steps: ref <- alpha * policy + (1 - alpha) * ref.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from grouprl.model.adapters import reference_mode
from grouprl.model.full_state import gathered, whole


@dataclass
class Reference:
    model: Optional[torch.nn.Module] = None  # a separate frozen model, or None: the PEFT policy itself
    adapter: Optional[str] = None  # with the PEFT policy: the frozen reference adapter (None = adapters disabled)

    @contextmanager
    def scoring(self, policy: torch.nn.Module, unwrapped_policy: Any) -> Iterator[torch.nn.Module]:
        """Yields the module whose forward computes pi_ref (run it under no_grad)."""
        if self.model is not None:
            yield self.model
            return
        with reference_mode(unwrapped_policy, self.adapter):
            yield policy

    def state_dict(self) -> Optional[dict[str, torch.Tensor]]:
        """What a checkpoint must hold to resume exactly: the reference weights, only if they change (sync), on the
        main process (which writes checkpoints; None on the others). A collective for a ZeRO-3 reference (its weights
        gathered one at a time): every process calls it."""
        if self.model is None:
            return None
        from accelerate import PartialState

        main = PartialState().is_main_process
        model = inner_model(self.model)
        state = {}
        for name, param in model.named_parameters():
            with gathered([param]):
                if main:
                    state[name] = param.detach().cpu().clone()
        if not main:
            return None
        state.update((name, buffer.detach().cpu()) for name, buffer in model.named_buffers())
        return state

    def load_state_dict(self, state: Optional[dict[str, torch.Tensor]]) -> None:
        """A `state_dict` back into the reference (every process calls it)."""
        if state is None or self.model is None:
            return
        model = inner_model(self.model)
        with torch.no_grad():
            for name, param in model.named_parameters():
                with gathered([param], modifier_rank=0):
                    param.copy_(state[name])
            for name, buffer in model.named_buffers():
                if name in state:  # a checkpoint written by state_dict() before it held them all
                    buffer.copy_(state[name])


def inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model itself: a ZeRO-3 reference lives in an inference engine of its own (`zero3_reference`)."""
    return model.module if type(model).__name__ == "DeepSpeedEngine" else model


def whole_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of the model with its whole weights. A model loaded under DeepSpeed ZeRO-3 holds only its shards
    (parameters with a ds_id, empty outside a gather): it is copied inside a gather, else the copy would be empty."""
    with gathered(list(model.parameters())):
        return copy.deepcopy(model)


def separate_reference_model(model_arg: Any, policy: torch.nn.Module, load: Any) -> torch.nn.Module:
    """A frozen, eval-mode reference model: `load(model_arg)` for an id / path, else a deep copy of `policy`."""
    reference = load(model_arg) if isinstance(model_arg, str) else whole_copy(policy)
    reference.requires_grad_(False)
    reference.eval()
    return reference


@torch.no_grad()
def mix_into_reference(reference: torch.nn.Module, policy: torch.nn.Module, alpha: float) -> None:
    """TR-DPO soft update: every reference parameter <- alpha * policy + (1 - alpha) * reference. Under sharding every
    process calls it: each policy weight is gathered whole (FSDP2, ZeRO-3), and a ZeRO-3 reference's weight is gathered,
    mixed and sharded again."""
    policy_params = dict(policy.named_parameters())
    for name, ref_param in inner_model(reference).named_parameters():
        source = policy_params[name]
        with gathered([source]), gathered([ref_param], modifier_rank=0):
            mixed = whole(source).to(device=ref_param.device, dtype=ref_param.dtype)
            ref_param.mul_(1.0 - alpha).add_(mixed, alpha=alpha)
