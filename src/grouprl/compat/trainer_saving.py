"""GRPOTrainer's saving surface: ``save_model``, ``push_to_hub`` and resuming
from a checkpoint (``_load_checkpoint``)."""

from __future__ import annotations

import os
from collections import deque
from typing import Any, Optional

from huggingface_hub import HfApi
from transformers import TrainerState
from transformers.utils import logging

from grouprl.core.metrics import JsonlWriter
from grouprl.model.adapters import save_pretrained
from grouprl.model.full_state import fsdp_sharded, gather_full_state
from grouprl.train.checkpoint import (
    ENGINE_STATE,
    TRAINER_STATE,
    load_optimizer_state,
    load_policy_weights,
    load_training_state,
    restore_rng_state,
)
from grouprl.train.checkpoint_files import read_file
from grouprl.train.optimizer_step import deepspeed_engine

logger = logging.get_logger("grouprl")


class TrainerSaving:
    """Expects ``self.run`` (training_run.TrainingRun), ``self.args``, ``self.state``, ``self.accelerator``,
    ``self.processing_class`` and ``self.create_model_card`` (TrainerReporting)."""

    def save_model(self, output_dir: Optional[str] = None) -> None:
        """Write the model and tokenizer (`from_pretrained`-loadable) to output_dir (default: args.output_dir)."""
        output_dir = output_dir or self.args.output_dir
        self.accelerator.wait_for_everyone()
        model = self.accelerator.unwrap_model(self.run.model)
        if deepspeed_engine(self.accelerator) is not None:  # ZeRO-3 gathers: every process takes part
            weights = self.accelerator.get_state_dict(self.run.model)
        else:
            weights = gather_full_state(model)[0] if fsdp_sharded(model) else None  # a collective: every process
        if self.accelerator.is_main_process:
            save_pretrained(model, output_dir, weights)  # a LoRA policy: the adapter only
            self.processing_class.save_pretrained(output_dir)

    def push_to_hub(self, commit_message: str = "End of training", **kwargs: Any) -> Any:
        """Save, write the model card, then push the model, tokenizer and card (README.md) to args.hub_model_id
        (default: output_dir's name), with args.hub_token / hub_private_repo / hub_revision unless given here.
        As Trainer's, `model_name`, `dataset_name` and `tags` go to create_model_card (TRL's script passes
        dataset_name); other keyword arguments go to the model's and tokenizer's push_to_hub."""
        card = {name: kwargs.pop(name) for name in ("model_name", "dataset_name", "tags") if name in kwargs}
        repo_id = self.args.hub_model_id or os.path.basename(os.path.abspath(self.args.output_dir))
        self.save_model()
        if not self.accelerator.is_main_process:
            return None
        card.setdefault("model_name", repo_id.split("/")[-1])
        self.create_model_card(**card)
        hub = {"token": self.args.hub_token, "private": self.args.hub_private_repo, "revision": self.args.hub_revision}
        kwargs = {**{k: v for k, v in hub.items() if v is not None}, **kwargs}
        model = self.accelerator.unwrap_model(self.run.model)
        self.processing_class.push_to_hub(repo_id, commit_message=commit_message, **kwargs)
        result = model.push_to_hub(repo_id, commit_message=commit_message, **kwargs)
        pushed = getattr(getattr(result, "repo_url", None), "repo_id", None)  # owner/name as the Hub resolved it
        self._pushed_repo_id = pushed or repo_id
        # after the model: its push writes a bare README.md, which the card replaces
        HfApi(token=kwargs.get("token")).upload_file(
            path_or_fileobj=os.path.join(self.args.output_dir, "README.md"),
            path_in_repo="README.md",
            repo_id=self._pushed_repo_id,
            revision=kwargs.get("revision"),
            commit_message=commit_message,
        )
        return result

    def _load_checkpoint(self, path: str) -> None:
        training, loop_state = load_training_state(path)
        model = self.accelerator.unwrap_model(self.run.model)
        engine = deepspeed_engine(self.accelerator)
        if engine is not None and training.get("optimizer_keys") == ENGINE_STATE:
            # each process its shards of the weights and the optimizer state (the schedule is grouprl's)
            engine.load_checkpoint(os.path.join(path, ENGINE_STATE), tag=ENGINE_STATE, load_lr_scheduler_states=False)
        else:
            load_policy_weights(model, path)
            load_optimizer_state(model, self.run.optimizer, training)
        self.run.scheduler.load_state_dict(training["scheduler"])
        restore_rng_state(training["rng"])
        self.run.load_loop_state(loop_state)
        processes = loop_state.get("processes")  # several processes: each one's RNG and buffered micro-batches
        if processes is not None:
            if len(processes) != self.accelerator.num_processes:
                raise ValueError(
                    f"Checkpoint {path} was written by {len(processes)} processes; resume it with the same number "
                    f"of processes (this run has {self.accelerator.num_processes})."
                )
            own = processes[self.accelerator.process_index]
            restore_rng_state(own["rng"])
            self.run.pending = deque(own["pending"])
            self.run.inputs = own.get("inputs")
        elif self.accelerator.num_processes > 1:  # written by one process (or a last-good save): its buffer is not ours
            logger.warning(
                f"{path} holds one process's buffered micro-batches; each of the {self.accelerator.num_processes} "
                "processes starts with a fresh generation instead."
            )
            self.run.pending.clear()
            self.run.inputs = None
        restored = read_file(path, TRAINER_STATE, TrainerState.load_from_json)  # a damaged file is named
        self.state.global_step, self.state.epoch, self.state.log_history = (
            restored.global_step,
            restored.epoch,
            restored.log_history,
        )
        self.state.total_flos, self.state.num_input_tokens_seen = restored.total_flos, restored.num_input_tokens_seen
        if self.accelerator.is_main_process:  # drop what the interrupted run logged after this checkpoint
            JsonlWriter(os.path.join(self.args.output_dir, "metrics.jsonl")).rewrite(self.state.log_history)
        logger.warning(f"Resumed from {path} at step {self.state.global_step}.")
