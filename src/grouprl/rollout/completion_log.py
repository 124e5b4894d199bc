"""log_completions: a table of what the model wrote and how it was scored (TRL 1.16 §1.6).

After each generation the latest table is kept: one row per completion of the (global) generation
batch with ``step``, ``prompt``, ``completion``, one column per reward function (its name; NaN
where it returned None), ``advantage``, and every column a reward function added with
``log_extra(column, values)``. At each logging step the main process

- writes it to ``output_dir/completions/completions_<step>.parquet`` (always),
- prints it as a rich table (the first ``num_completions_to_print`` rows; all if None),
- sends it to wandb and/or trackio when they are active trackers (``log_unique_prompts``:
  one row per prompt there);

and with ``log_completions_hub_repo`` the parquet files go to that Hub dataset repo (completion_upload.py).

Conversational prompts are shown as the chat-template text the model saw. Prompts with images
add an ``image`` column (each row's list of images) unless ``log_multimodal=False``: PNG bytes in
the parquet file, ``<N image(s)>`` on the console, image lists in the wandb / trackio tables.
"""

from __future__ import annotations

import io
import math
import os
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from grouprl.rollout.completion_upload import CompletionUpload

FIXED_COLUMNS = ("step", "prompt", "completion", "advantage")


class RecentCompletions:
    """TRL's ``trainer._logs``: the rows of the latest generation batch (all
    processes), kept whatever log_completions is.

    ``logs`` is a plain dict, as TRL's: ``prompt``, ``completion`` (as reward functions got them), ``advantages``,
    ``images`` (each row's prompt images; only with log_multimodal), deques of at most the generation batch
    size, and ``rewards`` / ``extra``: name -> such a deque (a reward function's values, NaN for None; a
    ``log_extra`` column). Scripts read it, or replace an entry (e.g. ``_logs["images"] = deque(maxlen=0)``).
    """

    def __init__(self, size: int, log_multimodal: bool = True):
        self.log_multimodal = log_multimodal
        recent = lambda: deque(maxlen=size)  # noqa: E731 - the factory of every column
        self.logs: dict[str, Any] = {
            "images": recent(),
            "prompt": recent(),
            "completion": recent(),
            "rewards": defaultdict(recent),
            "advantages": recent(),
            "extra": defaultdict(recent),
        }

    def record(
        self,
        accelerator: Accelerator,
        prompts: list[Any],  # (n,) this process's rows
        completions: list[Any],  # (n,)
        rewards: dict[str, torch.Tensor],  # name -> (N,) global, NaN for None
        advantages: torch.Tensor,  # (N,) global
        extras: dict[str, list[Any]],  # log_extra columns of this process, each (n,)
        images: list[list[Any]] | None = None,  # (n,) each row's prompt images, None without images
    ) -> None:
        """Append one generation batch (call on every process: prompts, completions and extras are gathered)."""
        gather = gather_object if accelerator.num_processes > 1 else list
        self.logs["prompt"].extend(gather(list(prompts)))
        self.logs["completion"].extend(gather(list(completions)))
        for name, values in rewards.items():
            self.logs["rewards"][name].extend(values.tolist())
        self.logs["advantages"].extend(advantages.tolist())
        names = sorted(set(gather(list(extras))))  # every process's column names
        for name in names:  # a column one process lacks is None on its rows (TRL)
            self.logs["extra"][name].extend(gather(list(extras.get(name, [None] * len(completions)))))
        if images is not None and self.log_multimodal:
            self.logs["images"].extend(gather([list(row) for row in images]))


@dataclass
class CompletionLog:
    output_dir: str
    num_completions_to_print: Optional[int] = None
    log_unique_prompts: bool = False
    log_multimodal: bool = True
    table: dict[str, list[Any]] = field(default_factory=dict)  # the latest generation, global rows
    upload: Optional[CompletionUpload] = None  # log_completions_hub_repo, on the main process

    def record(
        self,
        accelerator: Accelerator,
        prompts: list[str],  # (n,) this process's rows
        completions: list[str],  # (n,)
        rewards: dict[str, torch.Tensor],  # name -> (n,) with NaN for None
        advantages: torch.Tensor,  # (n,)
        extras: dict[str, list[Any]],  # log_extra columns, each (n,)
        images: list[list[Any]] | None = None,  # (n,) each row's prompt images (VLMs)
    ) -> None:
        """Keep this generation's rows (gathered from every process; call on all processes)."""
        n = len(completions)
        table: dict[str, list[Any]] = {"prompt": list(prompts), "completion": list(completions)}
        for name, values in rewards.items():
            table[name] = [None if math.isnan(v) else v for v in values.tolist()]
        table["advantage"] = advantages.tolist()
        if images is not None and self.log_multimodal:
            table["image"] = [list(row) for row in images]
        for name, values in extras.items():
            values = list(values)
            if len(values) != n:
                raise ValueError(
                    f"log_extra({name!r}, values): got {len(values)} values for {n} completions; give one per "
                    "completion."
                )
            table[name if name not in table else f"{name} (log_extra)"] = values
        if accelerator.num_processes > 1:
            table = {name: gather_object(values) for name, values in table.items()}
        self.table = table

    def write(self, step: int, accelerator: Accelerator) -> Optional[str]:
        """Parquet file, console table, tracker tables for the latest generation (main process only)."""
        if not self.table or not accelerator.is_main_process:
            return None
        n = len(self.table["completion"])
        table = {"step": [step] * n, **self.table}
        path = os.path.join(self.output_dir, "completions", f"completions_{step:05d}.parquet")
        write_parquet(table, path)
        print_table(table, self.num_completions_to_print)
        send_to_trackers(accelerator, table, step, unique_prompts=self.log_unique_prompts)
        return path

    def finish(self) -> None:
        """When training ends: upload the files the Hub dataset does not have yet (log_completions_hub_repo)."""
        if self.upload is not None:
            self.upload.finish()


def write_parquet(table: dict[str, list[Any]], path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {}
    for name, values in table.items():
        if name == "image":
            columns[name] = pa.array(
                [[png_bytes(image) for image in row] for row in values], type=pa.list_(pa.binary())
            )
            continue
        try:
            columns[name] = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):  # mixed types in a log_extra column: keep them as text
            columns[name] = pa.array([None if v is None else str(v) for v in values])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    temporary = path + ".tmp"
    pq.write_table(pa.table(columns), temporary)
    os.replace(temporary, path)


def print_table(table: dict[str, list[Any]], limit: Optional[int]) -> None:
    rows = len(table["completion"]) if limit is None else min(limit, len(table["completion"]))
    if rows <= 0:
        return
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:  # rich is optional: plain lines instead
        for r in range(rows):
            print(" | ".join(f"{name}={_cell(values[r])}" for name, values in table.items()), flush=True)
        return
    shown = Table(show_header=True, header_style="bold magenta", show_lines=True)
    for name in table:
        shown.add_column(name, style="bright_yellow" if name == "completion" else None)
    for r in range(rows):
        shown.add_row(*(_cell(values[r]) for values in table.values()))
    Console().print(shown)


def send_to_trackers(accelerator: Accelerator, table: dict[str, list[Any]], step: int, *, unique_prompts: bool) -> None:
    """A `completions` table for wandb / trackio, only when they are among the active trackers."""
    active = {getattr(tracker, "name", None) for tracker in accelerator.trackers}
    if not active & {"wandb", "trackio"}:
        return
    import pandas as pd

    def frame_for(backend: Any) -> Any:
        frame = pd.DataFrame(table)
        if "image" in frame:  # TRL: each row's images as the backend's Image objects
            frame["image"] = [[backend.Image(image) for image in row] for row in frame["image"]]
        return frame.drop_duplicates(subset=["prompt"]) if unique_prompts else frame

    if "wandb" in active:
        import wandb

        accelerator.get_tracker("wandb", unwrap=True).log(
            {"completions": wandb.Table(dataframe=frame_for(wandb))}, step=step
        )
    if "trackio" in active:
        import trackio

        trackio.log({"completions": trackio.Table(dataframe=frame_for(trackio))}, step=step)


def png_bytes(image: Any) -> bytes:
    """A PIL image (or an array) encoded as PNG."""
    from PIL import Image

    if not isinstance(image, Image.Image):
        image = Image.fromarray(image)
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _cell(value: Any) -> str:
    if isinstance(value, list) and value and not isinstance(value[0], (str, int, float)):  # a row's images
        return f"<{len(value)} image{'s' if len(value) > 1 else ''}>"
    return f"{value:.4g}" if isinstance(value, float) else str(value)
