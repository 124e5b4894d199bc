"""When the loop checkpoints the run, and what of the run goes into a checkpoint (checkpoint.py writes it).

`save` is the scheduled (or callback-asked) checkpoint after an optimizer step: every process's RNG and
buffered micro-batches, the main process's loop state. `write_checkpoint` writes the last good state
that the loop kept when a step failed (last_good_state.py).
"""

from __future__ import annotations

import os
from typing import Any, Optional

from grouprl.core.distributed import gather_objects, run_on_main
from grouprl.model.full_state import fsdp_sharded, gather_full_state
from grouprl.train.checkpoint import ENGINE_STAGING_PREFIX, ENGINE_STATE, SaveFailed, rng_state, save_checkpoint
from grouprl.train.training_run import TrainingRun, deepspeed_engine


def save(run: TrainingRun) -> Optional[str]:
    """Checkpoint the run (main process writes; all processes wait for it). A write that fails raises SaveFailed on
    every process."""
    run.accelerator.wait_for_everyone()
    path = None
    # every process's RNG and buffered micro-batches (the loop state below is the main process's)
    processes = (
        gather_objects({"rng": rng_state(), "pending": list(run.pending), "inputs": run.inputs})
        if run.accelerator.num_processes > 1
        else None
    )
    run.store_flos()
    full_state = gathered_policy_state(run, with_optimizer=not run.config.save_only_model)
    reference_state = run.reference_state()  # gathered by every process under ZeRO-3
    engine_state = None
    engine = deepspeed_engine(run.accelerator)
    if engine is not None and not run.config.save_only_model:  # a collective: every process writes its shards
        engine_state = os.path.join(run.config.output_dir, f"{ENGINE_STAGING_PREFIX}{run.state.global_step}")
        engine.save_checkpoint(engine_state, tag=ENGINE_STATE, save_latest=False)
        run.accelerator.wait_for_everyone()
    best_before = run.state.best_model_checkpoint
    if run.state.best_global_step == run.state.global_step and run.state.best_metric is not None:
        run.state.best_model_checkpoint = os.path.join(run.config.output_dir, f"checkpoint-{run.state.global_step}")
    run.state.stateful_callbacks = run.callbacks.states()

    def write() -> tuple[Optional[str], Optional[str]]:
        try:
            return save_checkpoint(
                run.config.output_dir,
                run.state.global_step,
                model=run.accelerator.unwrap_model(run.model),
                tokenizer=run.tokenizer,
                optimizer=run.optimizer,
                scheduler=run.scheduler,
                trainer_state=run.state,
                loop_state={
                    **run.loop_state(with_reference=False),
                    "reference_model": reference_state,
                    "processes": processes,
                },
                save_total_limit=run.config.save_total_limit,
                model_only=run.config.save_only_model,
                keep=run.state.best_model_checkpoint,
                full_state=full_state,
                engine_state=engine_state,
                training_args=run.config,
            ), None
        except SaveFailed as err:  # every process learns of it (and may train on: save_failure='continue')
            return None, str(err)

    path, failure = run_on_main(write)
    if failure is not None:
        run.state.best_model_checkpoint = best_before  # the new best's checkpoint does not exist
        raise SaveFailed(failure)
    run.fire("on_save")
    return path


def gathered_policy_state(run: TrainingRun, with_optimizer: bool = True) -> Optional[tuple[dict, Optional[dict]]]:
    """The full (weights, optimizer state) of a policy that FSDP shards, on the main process (a collective: every
    process calls it); under DeepSpeed the full weights (gathered under ZeRO-3) and no optimizer state (DeepSpeed
    writes its shards itself); None for a policy every process holds whole."""
    if deepspeed_engine(run.accelerator) is not None:
        return run.accelerator.get_state_dict(run.model), None
    model = run.accelerator.unwrap_model(run.model)
    if not fsdp_sharded(model):
        return None
    return gather_full_state(model, run.optimizer if with_optimizer else None)


def write_checkpoint(
    run: TrainingRun,
    step: int,
    loop_state: dict[str, Any],
    rng: Optional[dict[str, Any]],
    full_state: Optional[tuple[dict, Optional[dict]]] = None,
) -> None:
    """Write a checkpoint of the run at `step` with the given loop state and RNG (the last good state after a
    failure). `full_state`: gathered_policy_state's, which a sharded policy needs."""
    if deepspeed_engine(run.accelerator) is not None:
        raise RuntimeError(
            "DeepSpeed writes its optimizer state collectively at a scheduled checkpoint only; the latest scheduled "
            "checkpoint stands"
        )
    if full_state is None and fsdp_sharded(run.accelerator.unwrap_model(run.model)):
        raise RuntimeError(
            "the policy's weights are sharded over the processes and only this process stopped, so they cannot be "
            "gathered; the latest scheduled checkpoint stands"
        )
    run.state.stateful_callbacks = run.callbacks.states()
    save_checkpoint(
        run.config.output_dir,
        step,
        model=run.accelerator.unwrap_model(run.model),
        tokenizer=run.tokenizer,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        trainer_state=run.state,
        loop_state=loop_state,
        save_total_limit=run.config.save_total_limit,
        rng=rng,
        full_state=full_state,
        training_args=run.config,
    )
