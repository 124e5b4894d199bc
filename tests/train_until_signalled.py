"""A long training run for the signal tests: python train_until_signalled.py MODEL_DIR OUTPUT_DIR [--linger|--hang] (one
process or launched on several). It trains until a SIGINT / SIGTERM stops it; no scheduled checkpoint falls in the
test's window, so a checkpoint found afterwards is the one the signal wrote.

--linger: once a stop signal is received, the step's end waits (up to 60 s) before the checkpoint, so that the test's
second Ctrl-C lands while the run is stopping. Without it two signals sent a few milliseconds apart can both arrive
during one long C call, and Python then runs the handler once for both.

--hang: from step 4 on, the reward function never returns (a hung judge or sandbox)."""

import signal
import sys
import time

from checkpoint_run import distinct_tokens, make_trainer
from transformers import TrainerCallback


def stop_received() -> bool:
    handler = signal.getsignal(signal.SIGINT)  # the run's StopSignals._handle while train() runs
    return bool(getattr(getattr(handler, "__self__", None), "received", 0))


class LingerOnceStopped(TrainerCallback):
    def on_step_end(self, args, state, control, **kwargs):
        deadline = time.time() + 60
        while stop_received() and time.time() < deadline:
            time.sleep(0.01)  # Python code: a second Ctrl-C's handler runs here


def hangs_from_step_4(completion_ids, trainer_state, **kwargs):
    while trainer_state.global_step >= 3:
        time.sleep(0.01)
    return distinct_tokens(completion_ids)


if __name__ == "__main__":
    model_dir, output_dir = sys.argv[1:3]
    reward = hangs_from_step_4 if "--hang" in sys.argv[3:] else distinct_tokens
    trainer = make_trainer(
        model_dir, output_dir, reward, max_steps=10_000, save_steps=10_000, lr_scheduler_type="constant"
    )
    if "--linger" in sys.argv[3:]:
        trainer.add_callback(LingerOnceStopped())
    trainer.train()
    sys.exit(3)  # never reached in the tests: the signal ends the run
