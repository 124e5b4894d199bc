"""glibc malloc thresholds: freed blocks are reused instead of page-faulted in again."""

import resource

import pytest
import torch

from grouprl.model.patches import reuse_freed_host_memory


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


_FAULTS_SCRIPT = """
import ctypes, resource, torch
from grouprl.model import patches

def faults():
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        torch.ones(2_000_000)  # 8 MB
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start

if not patches.reuse_freed_host_memory():
    print("not glibc")
    raise SystemExit
libc = ctypes.CDLL("libc.so.6")
libc.mallopt(patches.M_MMAP_THRESHOLD, 128 * 1024)  # glibc's starting thresholds, held fixed
libc.mallopt(patches.M_TRIM_THRESHOLD, 128 * 1024)
untuned = faults()
assert patches.reuse_freed_host_memory()
faults()  # the heap grows once
print(untuned, faults())
"""


def test_after_tuning_freed_blocks_are_reused_without_page_faults():
    """In a fresh process (the suite's own heap, shaped by every earlier test, decides where its blocks come from)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT], capture_output=True, text=True, check=True).stdout
    if out.strip() == "not glibc":
        pytest.skip("not glibc: nothing to tune")
    untuned, tuned = (int(x) for x in out.split())
    assert untuned > 10_000  # every 8 MB block mapped afresh: a fault per page
    # 20 allocations of 8 MB = ~39,000 pages; reused from the heap they fault (almost) never.
    assert tuned < 500


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_free_heap_pages_go_back_to_the_os_only_when_enough_are_free(monkeypatch):
    """release_free_host_memory trims the heap's free pages (held there by blocks still alive between them),
    and leaves the heap alone while less than RELEASE_THRESHOLD is free."""
    from grouprl.model import patches

    if not reuse_freed_host_memory() or patches.free_heap_bytes() is None:  # blocks up to 32 MiB on the heap
        pytest.skip("not glibc >= 2.33")
    patches.release_free_host_memory()  # what earlier tests left free is no longer resident
    block = 2_000_000  # 8 MB of float32
    few = [torch.ones(block) for _ in range(20)]
    kept_few = few[1::2]
    del few  # 80 MB free
    # the heap may hold free blocks already (earlier tests'; new blocks may be carved from them): thresholds are
    # set from what is free now, 200 MB above it ...
    monkeypatch.setattr(patches, "RELEASE_THRESHOLD", patches.free_heap_bytes() + 200_000_000)
    resident = _resident_bytes()
    patches.release_free_host_memory()
    assert abs(resident - _resident_bytes()) < 20e6  # below the threshold: kept for reuse
    blocks = [torch.ones(block) for _ in range(80)]
    kept = blocks[1::2]  # alive between the freed ones: the heap cannot shrink from its top
    del blocks  # 320 MB free, resident
    monkeypatch.setattr(patches, "RELEASE_THRESHOLD", patches.free_heap_bytes() - 100_000_000)  # ... and below it
    resident = _resident_bytes()
    patches.release_free_host_memory()
    released = resident - _resident_bytes()
    assert released > 250e6, released
    assert len(kept) == 40 and len(kept_few) == 10


def test_the_loop_releases_free_host_memory_between_each_forward_and_its_backward(
    monkeypatch, tmp_path, tiny_model_dir
):
    """Between each micro-batch's loss and its backward, and nowhere else (the pages handed back fault in again)."""
    from helpers import distinct_tokens, numbered_prompts, quiet_config

    from grouprl import GRPOTrainer
    from grouprl.train import training_run

    events = []
    monkeypatch.setattr(training_run, "release_free_host_memory", lambda: events.append("release"))
    config = quiet_config(
        tmp_path, max_steps=2, per_device_train_batch_size=3, gradient_accumulation_steps=2, max_completion_length=4
    )
    trainer = GRPOTrainer(
        model=tiny_model_dir, reward_funcs=distinct_tokens, args=config, train_dataset=numbered_prompts()
    )
    real_loss = trainer.compute_loss
    monkeypatch.setattr(trainer, "compute_loss", lambda *a, **k: events.append("loss") or real_loss(*a, **k))
    real_backward = trainer.accelerator.backward
    monkeypatch.setattr(
        trainer.accelerator, "backward", lambda *a, **k: events.append("backward") or real_backward(*a, **k)
    )
    trainer.train()
    assert events == ["loss", "release", "backward"] * (2 * 2)  # 2 steps x 2 micro-batches
