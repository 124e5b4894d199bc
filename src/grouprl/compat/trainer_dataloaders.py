"""GRPOTrainer's dataloaders, as TRL's trainer has them: what a user iterates to see the batches the loop uses.

They read the same data as training and evaluation without moving their position.
"""

from __future__ import annotations

from typing import Any

import torch

from grouprl.data.generation_inputs import TrainPromptBatches
from grouprl.train.eval_data import eval_loader, pick_eval_dataset


class TrainerDataloaders:
    """Expects ``self.run`` (training_run.TrainingRun), ``self.args``, ``self.plan``, ``self.accelerator`` and
    ``self.eval_dataset``."""

    def get_train_dataloader(self) -> TrainPromptBatches:
        """One epoch of this process's generation batches, as TRL's dataloader yields them: lists of dataset rows
        (one per completion, each prompt repeated for its completions), each repeated steps_per_generation x
        num_iterations times; the same lists training_step receives. Iterating walks the prompt order from the start
        of an epoch without moving training's position; ``num_workers`` / ``loader`` are those of the DataLoader that
        fetches training's rows (dataloader_num_workers)."""
        rollouts = self.run.rollouts
        return TrainPromptBatches(
            rollouts.sampler,
            tokenize=rollouts.tokenize,
            num_generations=self.args.num_generations,
            repeats=self.plan.steps_per_generation * self.plan.num_iterations,
            process_index=self.accelerator.process_index,
            num_processes=self.accelerator.num_processes,
            remove_unused_columns=self.args.remove_unused_columns,
            default_prompt=rollouts.settings.default_prompt,
        )

    def get_eval_dataloader(self, eval_dataset: Any = None) -> torch.utils.data.DataLoader:
        """The DataLoader evaluation reads (a name of a dict eval_dataset, a dataset, or None: the trainer's); a
        stream gets 0 workers."""
        return eval_loader(
            pick_eval_dataset(self.eval_dataset, eval_dataset), self.args, self.accelerator.num_processes
        )
