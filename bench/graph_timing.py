"""Timing a piece of a decode step as the captured loop runs it: on CUDA recorded once as a CUDA graph and replayed,
elsewhere called eagerly. Shared by bench_sampling.py and bench_decode_attention.py."""

from __future__ import annotations

import time
from typing import Callable

import torch


def seconds_per_call(work: Callable[[], None], cuda: bool, repeat: int, per_timing: int) -> list[float]:
    """Seconds per call of `work`: `repeat` timings of `per_timing` calls each (replays of one recorded graph on
    CUDA, after a warm-up call outside the capture, where libraries make their lazy initialisations)."""
    run = work
    if cuda:
        from grouprl.generation.static_decode import capture_stream  # the loop's one side stream (its doc)

        side = capture_stream(torch.cuda.current_device())
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            work()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            work()
        run = graph.replay
    run()
    timings = []
    for _ in range(repeat):
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(per_timing):
            run()
        if cuda:
            torch.cuda.synchronize()
        timings.append((time.perf_counter() - started) / per_timing)
    return timings
