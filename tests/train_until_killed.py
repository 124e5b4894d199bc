"""Subprocess of test_checkpoint.py: trains the tiny model and, when asked, stops inside a checkpoint save.

    python train_until_killed.py MODEL_DIR OUTPUT_DIR PAUSE_AT_STEP

PAUSE_AT_STEP = N: once checkpoint-N's weights are written into its staging directory, create
OUTPUT_DIR/saving and sleep, so the parent's SIGKILL lands in the middle of that save.
"""

import os
import sys
import time

from checkpoint_run import make_trainer

from grouprl.train import checkpoint

model_dir, output_dir, pause_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
write_weights = checkpoint.save_pretrained


def pausing_save_pretrained(model, path, weights=None):
    write_weights(model, path, weights)
    if os.path.basename(path) == f"{checkpoint.STAGING_PREFIX}{pause_at}":
        open(os.path.join(output_dir, "saving"), "w").close()
        time.sleep(600)


checkpoint.save_pretrained = pausing_save_pretrained
make_trainer(model_dir, output_dir).train()
