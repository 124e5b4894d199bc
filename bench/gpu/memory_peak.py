"""What holds GPU memory at a step's peak: the allocations live at the moment the most bytes were allocated, summed
by the line of grouprl (or transformers, or torch) that made them, from a `torch.cuda.memory._snapshot()` taken
with memory history recorded (profile_step.py --memory).

    python3 bench/gpu/memory_peak.py SNAPSHOT.pickle[.gz] [--top 25]

The snapshot's trace holds the allocations and frees made while history was recorded; what was allocated before
(weights, optimizer states) is not in it: profile_step.py stores that total in the snapshot as `allocated_before`.
"""

from __future__ import annotations

import argparse
import gzip
import pickle
from collections import Counter
from typing import Any, Iterable

OWN_CODE = ("grouprl/", "transformers/", "accelerate/", "peft/", "bench/")


def where(frames: Iterable[dict]) -> str:
    """The innermost frame in grouprl, transformers, accelerate, peft or the bench; else the innermost Python one."""
    frames = list(frames)
    for frame in frames:
        name = frame.get("filename", "")
        if any(part in name for part in OWN_CODE) and not name.endswith(".cpp"):
            return f"{name.split('site-packages/')[-1].split('src/')[-1]}:{frame.get('line')} {frame.get('name')}"
    python = [f for f in frames if f.get("filename", "").endswith(".py")]
    if python:
        return f"{python[0]['filename'].split('site-packages/')[-1]}:{python[0].get('line')} {python[0].get('name')}"
    return "(no Python frame)"


def live_at_peak(trace: list[dict]) -> tuple[int, dict[int, dict]]:
    """(peak bytes above the trace's start, the allocations live then by address) from one device's trace events:
    'alloc' adds a block, 'free_completed' removes it (a free the trace never saw allocated was made before)."""
    live: dict[int, dict] = {}
    total = peak = peak_index = 0
    for index, event in enumerate(trace):
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
        elif event["action"] == "free_completed" and live.pop(event["addr"], None) is not None:
            total -= event["size"]
        if total > peak:
            peak, peak_index = total, index
    live = {}
    for event in trace[: peak_index + 1]:
        if event["action"] == "alloc":
            live[event["addr"]] = event
        elif event["action"] == "free_completed":
            live.pop(event["addr"], None)
    return peak, live


def report(snapshot: dict[str, Any], device: int = 0, top: int = 25) -> str:
    """The peak above the trace's start and its largest holders by line; `snapshot["allocated_before"]`, where
    profile_step.py put it (torch.cuda.memory_allocated() when recording began), is printed too."""
    trace = snapshot["device_traces"][device]
    peak, live = live_at_peak(trace)
    by_line = Counter()
    for event in live.values():
        by_line[where(event.get("frames", []))] += event["size"]
    lines = []
    if "allocated_before" in snapshot:
        lines.append(f"allocated when recording began: {snapshot['allocated_before'] / 2**30:.2f} GiB")
    lines.append(f"peak above that: {peak / 2**30:.2f} GiB, {len(live)} allocations live then; the largest by line:")
    lines += [f"  {size / 2**20:9.1f} MiB  {line}" for line, size in by_line.most_common(top)]
    return "\n".join(lines)


def load(path: str) -> dict[str, Any]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as handle:
        return pickle.load(handle)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("snapshot")
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    print(report(load(args.snapshot), top=args.top))


if __name__ == "__main__":
    main()
