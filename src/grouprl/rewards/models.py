"""Reward models: sequence-classification models used as reward functions (TRL 1.16 §2.5).

An entry of ``reward_funcs`` that is a string (Hub id or local path) is loaded with
``AutoModelForSequenceClassification.from_pretrained(id, num_labels=1, **model_init_kwargs)`` and
its own tokenizer (``AutoTokenizer`` from the same path) unless ``reward_processing_classes``
gives one; a ``PreTrainedModel`` instance is used as is. Each becomes a `RewardModel`, a plain
callable with the reward-function contract, so the scoring code treats models and functions alike.

Scoring: conversational samples are rendered with the *reward* tokenizer's chat template
(prompt messages + the completion message, ``chat_template_kwargs`` applied); standard samples
are prompt + completion strings. Texts are tokenized without added special tokens, right-padded,
run in micro-batches under ``torch.inference_mode``, and the reward is the single logit at the
last non-pad token (the model's ``pad_token_id`` is set to the tokenizer's so its pooling finds it).
The name (for metrics) is the last component of the model's path, as in TRL.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedModel


class RewardModel:
    """A sequence-classification model with its tokenizer, called like a reward function."""

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any,
        *,
        batch_size: int = 8,
        chat_template_kwargs: Optional[dict] = None,
    ):
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.batch_size = max(1, int(batch_size))
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is None:
                raise ValueError(
                    f"Reward model {self.__name__!r}: its tokenizer has neither a pad nor an EOS token; set "
                    "tokenizer.pad_token."
                )
            tokenizer.pad_token = tokenizer.eos_token
        model.config.pad_token_id = tokenizer.pad_token_id  # the classification head pools at the last non-pad token
        if getattr(model.config, "num_labels", 1) != 1:
            raise ValueError(
                f"Reward model {self.__name__!r} has num_labels={model.config.num_labels}; a reward model outputs one "
                "score (num_labels=1)."
            )

    @property
    def __name__(self) -> str:  # noqa: A003 - the reward's metric name, as for functions
        path = str(getattr(self.model.config, "_name_or_path", "") or "").rstrip("/")
        return os.path.basename(path) or type(self.model).__name__

    def to(self, device: Any) -> "RewardModel":
        self.model.to(device)
        return self

    def render(self, prompt: Any, completion: Any) -> str:
        if isinstance(prompt, str):
            return prompt + (completion if isinstance(completion, str) else completion[0]["content"])
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError(
                f"Reward model {self.__name__!r}: the samples are conversational but its tokenizer has no chat "
                "template."
            )
        text = self.tokenizer.apply_chat_template(
            list(prompt) + list(completion), tokenize=False, **self.chat_template_kwargs
        )
        return text

    def __call__(self, prompts: list, completions: list, **kwargs: Any) -> list[float]:
        texts = [self.render(p, c) for p, c in zip(prompts, completions)]
        device = next(self.model.parameters()).device
        scores: list[float] = []
        with torch.inference_mode():
            for start in range(0, len(texts), self.batch_size):
                encoded = self.tokenizer(
                    texts[start : start + self.batch_size],
                    padding=True,
                    padding_side="right",
                    add_special_tokens=False,
                    return_tensors="pt",
                )
                logits = self.model(
                    input_ids=encoded["input_ids"].to(device), attention_mask=encoded["attention_mask"].to(device)
                ).logits
                scores.extend(logits[:, 0].float().cpu().tolist())  # (b,)
        return scores


def is_reward_model(entry: Any) -> bool:
    return isinstance(entry, (str, torch.nn.Module))


def check_reward_funcs(reward_funcs: Any, reward_processing_classes: Any) -> tuple[list[Any], list[Any]]:
    """Validate reward_funcs and reward_processing_classes without loading anything; return both as lists."""
    from grouprl.rewards.scoring import prepare_reward_functions

    funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    if not funcs:
        raise ValueError("GRPOTrainer needs at least one reward function in reward_funcs.")
    functions = [f for f in funcs if not is_reward_model(f)]
    if functions:
        prepare_reward_functions(functions)  # raises on non-callables, naming them
    return funcs, match_processing_classes(funcs, reward_processing_classes)


def match_processing_classes(reward_funcs: Sequence[Any], reward_processing_classes: Any) -> list[Any]:
    """One processing class (or None) per reward function; a single one is wrapped in a list (TRL)."""
    if reward_processing_classes is None:
        return [None] * len(reward_funcs)
    classes = (
        list(reward_processing_classes)
        if isinstance(reward_processing_classes, (list, tuple))
        else [reward_processing_classes]
    )
    if len(classes) != len(reward_funcs):
        raise ValueError(
            f"The number of reward processing classes ({len(classes)}) must match the number of reward functions "
            f"({len(reward_funcs)}). Give one per entry of reward_funcs, in the same order, with None for plain "
            "functions and for reward models that should load their own tokenizer."
        )
    return classes


def load_reward_functions(
    reward_funcs: Sequence[Any],
    processing_classes: Sequence[Any],
    *,
    model_init_kwargs: Optional[dict] = None,
    trust_remote_code: bool = False,
    chat_template_kwargs: Optional[dict] = None,
    batch_size: int = 8,
    device: Any = None,
) -> list[Any]:
    """Replace every reward model entry (id, path or model) by a `RewardModel`; functions pass through."""
    loaded = []
    for index, (entry, tokenizer) in enumerate(zip(reward_funcs, processing_classes)):
        if not is_reward_model(entry):
            loaded.append(entry)
            continue
        if isinstance(entry, str):
            model = _load_model(entry, model_init_kwargs, trust_remote_code)
        elif isinstance(entry, PreTrainedModel):
            model = entry
        else:
            raise TypeError(
                f"reward_funcs[{index}] is a {type(entry).__name__}; a reward model must be a model id / path or a "
                "transformers PreTrainedModel (AutoModelForSequenceClassification with num_labels=1)."
            )
        if tokenizer is None:
            source = entry if isinstance(entry, str) else getattr(model.config, "_name_or_path", None)
            if not source:
                raise ValueError(
                    f"reward_funcs[{index}]: cannot find a tokenizer for this reward model; pass it in "
                    "reward_processing_classes."
                )
            tokenizer = AutoTokenizer.from_pretrained(
                source, trust_remote_code=trust_remote_code, revision=(model_init_kwargs or {}).get("revision")
            )
        reward_model = RewardModel(model, tokenizer, batch_size=batch_size, chat_template_kwargs=chat_template_kwargs)
        loaded.append(reward_model.to(device) if device is not None else reward_model)
    return loaded


def _load_model(path: str, model_init_kwargs: Optional[dict], trust_remote_code: bool) -> PreTrainedModel:
    kwargs = dict(model_init_kwargs or {})
    kwargs.pop("device_map", None)  # placed on this process's device by the trainer
    dtype = kwargs.pop("dtype", kwargs.pop("torch_dtype", "float32"))
    if isinstance(dtype, str) and dtype != "auto":
        dtype = getattr(torch, dtype)
    kwargs.setdefault("trust_remote_code", trust_remote_code)
    try:
        return AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype, **kwargs)
    except OSError as err:
        raise OSError(f"Could not load the reward model {path!r}: {err}") from err
