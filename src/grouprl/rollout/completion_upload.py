"""log_completions_hub_repo: the completion logs uploaded to a Hub dataset repo while the run trains (TRL 1.16).

The main process creates the dataset repo (private with hub_private_repo), gives it a card, and hands
``output_dir/completions`` to huggingface_hub's CommitScheduler, which uploads the parquet files written since its
last commit every two minutes, in a thread of its own: a failed upload is logged there and the run goes on, the files
staying on disk. When training ends, what is left is uploaded before train() returns.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from transformers.utils import logging

logger = logging.get_logger("grouprl")

UPLOAD_EVERY_MINUTES = 2

CARD = """---
tags:
- grouprl
- completions
---
# Completion logs of a GRPO run

Written by grouprl with `log_completions=True`: one parquet file per logging step
(`completions_<step>.parquet`), one row per completion of the latest generation, with the columns `step`, `prompt`,
`completion`, one per reward function, `advantage`, and any a reward function added with `log_extra`.
{model}"""


class CompletionUpload:
    """Uploads the parquet files of `folder` to the dataset repo `repo_id` (see the module doc)."""

    def __init__(
        self, repo_id: str, folder: str, *, private: Optional[bool], token: Optional[str], model: Optional[str]
    ):
        from huggingface_hub import CommitScheduler, HfApi

        api = HfApi(token=token)
        os.makedirs(folder, exist_ok=True)
        try:
            repo_id = api.create_repo(repo_id, repo_type="dataset", private=private, exist_ok=True).repo_id
            card = CARD.format(model=f"\nThe model trained: `{model}`.\n" if model else "")
            api.upload_file(
                path_or_fileobj=card.encode(), path_in_repo="README.md", repo_id=repo_id, repo_type="dataset"
            )
        except Exception as err:  # noqa: BLE001 - any Hub failure at the start is the user's to fix before training
            raise RuntimeError(
                f"GRPOConfig.log_completions_hub_repo={repo_id!r}: the Hub dataset repo could not be created: {err}. "
                "Log in (`hf auth login`, or HF_TOKEN / hub_token) with write access, or unset "
                f"log_completions_hub_repo (the logs are written to {folder} anyway)."
            ) from err
        self.repo_id, self.folder = repo_id, folder
        self.scheduler: Any = CommitScheduler(
            repo_id=repo_id,
            repo_type="dataset",
            folder_path=folder,
            every=UPLOAD_EVERY_MINUTES,
            allow_patterns=["*.parquet"],
            private=private,
            hf_api=api,
        )

    def finish(self) -> None:
        """Upload the files written since the last commit, then stop the schedule."""
        try:
            self.scheduler.trigger().result()
        except Exception as err:  # noqa: BLE001 - the run is over; losing the upload must not lose its result
            logger.warning(
                f"grouprl: the last completion logs could not be uploaded to the Hub dataset {self.repo_id}: {err}. "
                f"They are in {self.folder}."
            )
        finally:
            self.scheduler.stop()
