"""Trainer callbacks: ``transformers.TrainerCallback`` objects, called at TRL's (Trainer's) events.

A TRL script passes ``GRPOTrainer(callbacks=[...])`` with subclasses of ``TrainerCallback``; grouprl
calls the same methods with the same arguments: ``(args, state, control, **kwargs)``, where ``args``
is the ``GRPOConfig``, ``state`` the ``transformers.TrainerState`` and ``control`` a
``transformers.TrainerControl``; the keyword arguments are ``model``, ``processing_class``,
``optimizer``, ``lr_scheduler``, ``train_dataloader`` / ``eval_dataloader`` (always None: grouprl
has no dataloaders), plus ``logs`` (on_log) and ``metrics`` (on_evaluate).

Events, in the order the loop reaches them (loop.py): on_init_end (end of the constructor),
on_train_begin, on_epoch_begin, then per optimizer step on_step_begin, on_substep_end (after each
micro-batch but the last of a gradient accumulation), on_pre_optimizer_step (gradients clipped,
not yet applied), on_optimizer_step, on_step_end, on_log, on_evaluate, on_save; on_epoch_end when an epoch's
last step is done, and on_train_end.

The flags a callback sets on ``control`` are honoured after on_step_end: ``should_log``,
``should_evaluate`` (when there is an eval dataset) and ``should_save`` add a log entry, an
evaluation or a checkpoint at this step on top of the configured schedule, and
``should_training_stop`` ends training after this step (its log / save still happen). A callback
may also return a ``TrainerControl``, which then replaces the current one, as in transformers.

A checkpoint's ``trainer_state.json`` holds the state of every "exportable" callback (``ExportableState``,
e.g. EarlyStoppingCallback's patience counter) and of the control, under ``stateful_callbacks`` as transformers
writes it. A resume with ``restore_callback_states_from_checkpoint=True`` rebuilds those callbacks from it
(``from_state``), each in its place among the others; otherwise they start afresh, as in transformers.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

from transformers import TrainerCallback, TrainerControl
from transformers.trainer_callback import ExportableState

logger = logging.getLogger(__name__)

EVENTS = (
    "on_init_end",
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_step_begin",
    "on_substep_end",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_step_end",
    "on_log",
    "on_evaluate",
    "on_save",
)


class CallbackHandler:
    """The trainer's callbacks and the one ``TrainerControl`` they share; ``fire`` calls an event on each in order."""

    def __init__(self, callbacks: Optional[list] = None, **objects: Any):
        self.callbacks: list[TrainerCallback] = []
        self.objects = objects  # model, processing_class, optimizer, lr_scheduler: passed to every event
        self.control = TrainerControl()
        for callback in callbacks or []:
            self.add(callback)

    def add(self, callback: Union[TrainerCallback, type]) -> None:
        """Add a callback instance, or a TrainerCallback class (instantiated
        without arguments, as transformers does)."""
        if isinstance(callback, type):
            callback = callback()
        missing = [name for name in ("on_step_end", "on_log") if not callable(getattr(callback, name, None))]
        if missing:
            raise TypeError(
                f"callbacks: {type(callback).__name__} has no {', '.join(missing)} method; pass a subclass of "
                "transformers.TrainerCallback (it provides every event as a no-op to override)."
            )
        self.callbacks.append(callback)

    def pop(self, callback: Union[TrainerCallback, type]) -> Optional[TrainerCallback]:
        """Remove and return the callback (an instance, or the first of a class); None if absent."""
        for index, present in enumerate(self.callbacks):
            if present is callback or (isinstance(callback, type) and isinstance(present, callback)):
                return self.callbacks.pop(index)
        return None

    def fire(self, event: str, args: Any, state: Any, **extra: Any) -> TrainerControl:
        """Call ``event`` on every callback; return the (possibly replaced) control."""
        if event not in EVENTS:
            raise ValueError(f"Unknown callback event {event!r}; events are {', '.join(EVENTS)}.")
        for callback in self.callbacks:
            try:
                result = getattr(callback, event)(
                    args, state, self.control, train_dataloader=None, eval_dataloader=None, **self.objects, **extra
                )
            except AttributeError as error:
                if getattr(error, "obj", None) is args:  # a field neither GRPOConfig nor TrainingArguments has
                    raise AttributeError(
                        f"Callback {type(callback).__name__}.{event} reads GRPOConfig.{error.name}, which is not a "
                        "field of GRPOConfig (nor of transformers.TrainingArguments, which it extends); give the "
                        "callback the value another way."
                    ) from error
                raise
            if isinstance(result, TrainerControl):
                self.control = result
        return self.control

    def states(self) -> dict[str, Any]:
        """The exportable callbacks' and the control's ``state()`` by class name (a list where a class occurs more
        than once): transformers' ``TrainerState.stateful_callbacks``."""
        states: dict[str, Any] = {}
        for callback in [*self.callbacks, self.control]:
            if isinstance(callback, ExportableState):
                name = type(callback).__name__
                if name not in states:
                    states[name] = callback.state()
                elif isinstance(states[name], list):
                    states[name].append(callback.state())
                else:
                    states[name] = [states[name], callback.state()]
        return states

    def restore(self, states: dict[str, Any]) -> None:
        """Rebuild the callbacks (and the control) whose class `states` names from their stored state, in order
        where a class occurs more than once; a stored callback this run lacks is named and left out."""
        missing = []
        for name, stored in states.items():
            stored = stored if isinstance(stored, list) else [stored]
            places = [i for i, callback in enumerate(self.callbacks) if type(callback).__name__ == name]
            if type(self.control).__name__ == name:
                self.control = type(self.control).from_state(stored[0])
            elif not places:
                missing.append(name)
            for place, state in zip(places, stored):
                self.callbacks[place] = type(self.callbacks[place]).from_state(state)
        if missing:
            logger.warning(
                f"The checkpoint holds the state of callbacks this run does not have ({', '.join(missing)}); "
                "it is left out. Pass them to GRPOTrainer(callbacks=...) to restore them."
            )

    def new_step(self) -> None:
        """Flags that apply to one step are cleared before the next, as in transformers."""
        self.control.should_log = self.control.should_evaluate = self.control.should_save = False
