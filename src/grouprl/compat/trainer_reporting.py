"""GRPOTrainer's reporting surface, as transformers.Trainer and TRL's GRPOTrainer have it.

``log`` (one log entry: TRL's GRPO version merges the metrics gathered since the last entry), ``log_metrics`` /
``save_metrics`` / ``save_state`` (transformers' own helpers), ``create_model_card`` (README.md in output_dir,
written offline with huggingface_hub's ModelCard), ``end`` (what ``trl grpo`` calls last), ``hub_model_id``,
``is_world_process_zero`` / ``is_local_process_zero`` and ``_logs`` (TRL's buffer of the latest completions).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

import huggingface_hub
import torch
import transformers
from huggingface_hub import ModelCard, ModelCardData
from transformers.trainer_pt_utils import log_metrics, metrics_format, save_metrics, save_state

from grouprl._version import __version__
from grouprl.train import stages

GRPO_PAPER = ("DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open Language Models", "2402.03300")


class TrainerReporting:
    """Expects ``self.run`` (training_run.TrainingRun), ``self.args``, ``self.model``, ``self.state``,
    ``self.accelerator``."""

    # transformers' helpers take the trainer as `self`: identical files and console output.
    log_metrics = log_metrics
    save_metrics = save_metrics
    save_state = save_state
    metrics_format = staticmethod(metrics_format)

    def log(self, logs: dict[str, Any], start_time: Optional[float] = None) -> None:
        """Log `logs`: log_history (with epoch and step), the report_to trackers, the callbacks' on_log, metrics.jsonl
        and a console line; in training mode the metrics gathered since the last entry are merged in first
        (stages.own_log)."""
        stages.own_log(self.run, logs, start_time)

    def is_world_process_zero(self) -> bool:
        """Whether this is the main process of the whole launch."""
        return self.accelerator.is_main_process

    def is_local_process_zero(self) -> bool:
        """Whether this is the main process of its machine."""
        return self.accelerator.is_local_main_process

    @property
    def hub_model_id(self) -> str:
        """The Hub repository the model goes to: the one push_to_hub created (``owner/name``), else
        ``args.hub_model_id``, else output_dir's name (what Trainer creates the repository from)."""
        return (
            getattr(self, "_pushed_repo_id", None)
            or self.args.hub_model_id
            or Path(self.args.output_dir).absolute().name
        )

    @property
    def _logs(self) -> dict[str, Any]:
        """TRL's buffer of the latest generation batch (all processes): ``prompt``, ``completion``, ``advantages``,
        ``images`` (with log_multimodal), ``rewards[name]``, ``extra[column]``; see completion_log.RecentCompletions."""
        return self.run.rollouts.recent.logs

    @_logs.setter
    def _logs(self, logs: dict[str, Any]) -> None:  # a script may swap the whole dict, as with TRL's attribute
        self.run.rollouts.recent.logs = logs

    def create_model_card(
        self,
        model_name: Optional[str] = None,
        dataset_name: Optional[str] = None,
        tags: Union[str, list[str], None] = None,
    ) -> None:
        """Write a model card (README.md) to output_dir, as TRL's: front matter (base model, library, tags, datasets)
        and a description of the GRPO run. Main process only; no network access."""
        if not self.is_world_process_zero():
            return
        name_or_path = getattr(self.accelerator.unwrap_model(self.model).config, "_name_or_path", None) or None
        base_model = (
            name_or_path if name_or_path and not os.path.isdir(name_or_path) else None
        )  # a Hub id, not a local folder
        tags = {tags} if isinstance(tags, str) else set(tags or [])
        tags.update({"grouprl", "grpo"})
        if "JOB_ID" in os.environ:
            tags.add("hf_jobs")
        data = ModelCardData(
            base_model=base_model,
            library_name="transformers",
            model_name=model_name,
            tags=sorted(tags),
            datasets=[dataset_name] if dataset_name else None,
        )
        card = ModelCard(f"---\n{data.to_yaml()}\n---\n\n{self._model_card_body(model_name, base_model, dataset_name)}")
        os.makedirs(self.args.output_dir, exist_ok=True)
        card.save(os.path.join(self.args.output_dir, "README.md"))

    def _model_card_body(
        self, model_name: Optional[str], base_model: Optional[str], dataset_name: Optional[str]
    ) -> str:

        args, state = self.args, self.state
        title = model_name or Path(args.output_dir).absolute().name
        origin = (
            f"a fine-tuned version of [{base_model}](https://huggingface.co/{base_model})"
            if base_model
            else "a fine-tuned model"
        )
        data = f" on [{dataset_name}](https://huggingface.co/datasets/{dataset_name})" if dataset_name else ""
        settings = {
            "loss_type": args.loss_type,
            "num_generations": args.num_generations,
            "beta": args.beta,
            "learning_rate": args.learning_rate,
            "max_completion_length": args.max_completion_length,
            "optimizer steps": state.global_step,
        }
        title_paper, paper_id = GRPO_PAPER
        return "\n".join(
            [
                f"# Model card for {title}",
                "",
                f"This model is {origin}{data}, trained with reinforcement learning by GRPO (group relative policy "
                "optimization) with grouprl, a drop-in replacement for TRL's GRPOTrainer.",
                "",
                "## Quick start",
                "",
                "```python",
                "from transformers import pipeline",
                "",
                f'generator = pipeline("text-generation", model="{self.hub_model_id}")',
                'print(generator([{"role": "user", "content": "Hello!"}], max_new_tokens=128, '
                'return_full_text=False)[0]["generated_text"])',
                "```",
                "",
                "## Training procedure",
                "",
                f"GRPO, introduced in [{title_paper}](https://huggingface.co/papers/{paper_id}), samples a group of "
                "completions per prompt, scores them with reward functions and raises the likelihood of the "
                "completions that beat their group's mean.",
                "",
                *[f"- {key}: {value}" for key, value in settings.items()],
                "",
                "### Framework versions",
                "",
                f"- grouprl: {__version__}",
                f"- Transformers: {transformers.__version__}",
                f"- PyTorch: {torch.__version__}",
                f"- huggingface_hub: {huggingface_hub.__version__}",
                "",
                "## Citation",
                "",
                "```bibtex",
                "@article{shao2024deepseekmath,",
                f"  title   = {{{title_paper}}},",
                "  author  = {Shao, Zhihong and Wang, Peiyi and Zhu, Qihao and Xu, Runxin and Song, Junxiao and Zhang, "
                "Mingchuan and Li, Y. K. and Wu, Y. and Guo, Daya},",
                "  year    = {2024},",
                f"  eprint  = {{arXiv:{paper_id}}}",
                "}",
                "```",
                "",
            ]
        )

    def end(self) -> None:
        """Finish the report_to trackers and end the distributed process group (transformers' Trainer.end, which
        ``trl grpo`` calls last). Call it once, after everything that needs the
        other processes (save_model, push_to_hub)."""
        self.accelerator.end_training()
