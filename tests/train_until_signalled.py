"""A long training run for the signal tests: python train_until_signalled.py MODEL_DIR OUTPUT_DIR (one process or
launched on several). It trains until a SIGINT / SIGTERM stops it; no scheduled checkpoint falls in the test's
window, so a checkpoint found afterwards is the one the signal wrote."""

import sys

from checkpoint_run import make_trainer

if __name__ == "__main__":
    model_dir, output_dir = sys.argv[1:3]
    make_trainer(model_dir, output_dir, max_steps=10_000, save_steps=10_000, lr_scheduler_type="constant").train()
    sys.exit(3)  # never reached in the tests: the signal ends the run
