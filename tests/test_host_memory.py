"""glibc malloc thresholds: freed blocks are reused instead of page-faulted in again."""

import resource

import pytest
import torch

from grouprl.model.host_memory import reuse_freed_host_memory


def _faults_of_repeated_allocations() -> int:
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        torch.ones(2_000_000)  # 8 MB, above glibc's default (dynamic) mmap threshold for a fresh process
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start


@pytest.mark.parametrize("opted_in", [False, True])
def test_malloc_is_tuned_only_when_the_config_asks_and_only_for_a_cpu_model(monkeypatch, opted_in):
    """A process-wide setting that cannot be undone: made inside grouprl_patches
    only with keep_freed_host_memory=True."""
    from types import SimpleNamespace

    from grouprl.model import patches

    calls = []
    monkeypatch.setattr(patches, "reuse_freed_host_memory", lambda: calls.append(1) or True)
    cpu_model = torch.nn.Linear(2, 2)
    with patches.grouprl_patches(cpu_model, SimpleNamespace(keep_freed_host_memory=opted_in)):
        pass
    with patches.grouprl_patches(torch.nn.Linear(2, 2, device="meta"), SimpleNamespace(keep_freed_host_memory=True)):
        pass  # not a CPU model: never
    with patches.grouprl_patches(cpu_model):
        pass  # no config: never
    assert calls == ([1] if opted_in else [])


def test_after_tuning_freed_blocks_are_reused_without_page_faults():
    import ctypes

    from grouprl.model import host_memory

    if not reuse_freed_host_memory():
        pytest.skip("not glibc: nothing to tune")
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(host_memory.M_MMAP_THRESHOLD, 128 * 1024)  # glibc's starting thresholds, held fixed
    libc.mallopt(host_memory.M_TRIM_THRESHOLD, 128 * 1024)
    assert _faults_of_repeated_allocations() > 10_000  # every 8 MB block mapped afresh: a fault per page
    assert reuse_freed_host_memory()
    _faults_of_repeated_allocations()  # the heap grows once
    # 20 allocations of 8 MB = ~39,000 pages; reused from the heap they fault (almost) never.
    assert _faults_of_repeated_allocations() < 500
