"""The benchmark harness's own logic (the benchmarks themselves run from bench/run_all.py, not in CI)."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import bench_bounds  # noqa: E402
import run_all  # noqa: E402


def _run(seconds: float, **extra) -> dict:
    return {
        "seconds_per_step": seconds,
        "generated_tokens_per_step": 4000.0,
        "generated_tokens_per_second": 4000.0 / seconds,
        "useful_gflops_per_second": 100.0 / seconds,
        "peak_rss_mib": 1000.0,
        **extra,
    }


def test_median_run_rescales_rates_to_the_median_step_time():
    merged = run_all.median_run([_run(10.0), _run(14.0), _run(12.5)])
    assert merged["seconds_per_step"] == 12.5 and merged["runs"] == [10.0, 14.0, 12.5]
    assert merged["generated_tokens_per_second"] == pytest.approx(4000.0 / 12.5)
    assert merged["useful_gflops_per_second"] == pytest.approx(100.0 / 12.5)
    two = run_all.median_run([_run(10.0), _run(12.0)])
    assert two["seconds_per_step"] == 11.0 and two["generated_tokens_per_second"] == pytest.approx(4000.0 / 11.0)
    assert run_all.median_run([{"error": "boom"}]) == {"error": "boom"}


def test_report_replaces_only_the_generated_section(tmp_path):
    path = tmp_path / "benchmarks.md"
    path.write_text(f"# Benchmarks\n\nintro kept\n{run_all.START}\nold table\n{run_all.END}\n\nanalysis kept\n")
    bounds = {
        "W1": {
            "floor_seconds_per_step": 8.0,
            "decode_floor_seconds": 3.0,
            "train_floor_seconds": 4.9,
            "prefill_floor_seconds": 0.1,
        }
    }
    rows = [("W1", run_all.median_run([_run(10.0)]), run_all.median_run([_run(12.0)]))]
    run_all.write_report(str(path), {"float32": 160.0, "bfloat16": 1.0}, rows, [], 1, bounds)
    text = path.read_text()
    assert "old table" not in text and "intro kept" in text and "analysis kept" in text
    assert "| 1.20x |" in text  # TRL 12 s / grouprl 10 s
    assert "| W1 | 3.00 | 5.00 | 8.00 | 1.25 | 1.50x |" in text  # floor row: grouprl and TRL over the floor
    path.write_text("no markers\n")
    with pytest.raises(SystemExit, match="GENERATED"):
        run_all.write_report(str(path), {"float32": 160.0, "bfloat16": 1.0}, rows, [], 1, bounds)


def test_bounds_time_products_per_token():
    weights = [torch.randn(32, 16), torch.randn(16, 32)]
    rates = bench_bounds.per_token_seconds(weights)
    assert set(rates) == {"forward", "input_grad", "weight_grad"} and all(v > 0 for v in rates.values())
    assert bench_bounds.decode_seconds(weights, torch.randn(50, 16), rows=4) > 0


def test_floor_is_the_median_measurement_and_pairs_are_listed():
    floors = [{"floor_seconds_per_step": s, "decode_floor_seconds": s / 2} for s in (9.0, 7.0, 8.0)]
    assert run_all.median_floor(floors) == {"floor_seconds_per_step": 8.0, "decode_floor_seconds": 4.0}
    ours, theirs = run_all.median_run([_run(10.0), _run(20.0)]), run_all.median_run([_run(30.0), _run(30.0)])
    assert run_all.pair_speedups(ours, theirs) == [3.0, 1.5]  # each alternating pair, in run order


def test_a_recorded_run_is_read_back_and_a_record_of_another_dtype_is_refused(tmp_path):
    record = tmp_path / "record.jsonl"
    assert run_all.read_record(str(record), "bf16") == {}  # nothing recorded yet: measure everything
    entry = {"workload": "W1", "dtype": "bf16", "ours": [_run(10.0)], "theirs": [_run(20.0)], "floors": [], "peaks": []}
    record.write_text(json.dumps(entry) + "\n" + json.dumps({**entry, "ours": [_run(9.0)]}) + "\n")
    assert run_all.read_record(str(record), "bf16")["W1"]["ours"] == [_run(9.0)]  # the last entry wins
    with pytest.raises(SystemExit, match="holds bf16 runs, this run is --dtype fp32"):
        run_all.read_record(str(record), "fp32")


def test_bounds_run_in_the_weights_dtype():
    weights = [torch.randn(32, 16, dtype=torch.bfloat16)]
    assert bench_bounds.decode_seconds(weights, torch.randn(50, 16, dtype=torch.bfloat16), rows=4) > 0
    assert bench_bounds.per_token_seconds(weights)["weight_grad"] > 0


def test_the_cpu_sentence_names_an_instruction_set_limit(monkeypatch):
    """A run with PyTorch/oneDNN/MKL held to AVX2 on an AVX-512 CPU must say so next to the CPU's own flags."""
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        monkeypatch.delenv(name, raising=False)
    rows = [("W1", {"dtype": "fp32"}, {"dtype": "fp32"})]
    assert "limited" not in run_all.cpu_sentence(rows)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    sentence = run_all.cpu_sentence(rows)
    assert "**fp32**" in sentence and "bf16 is native" not in sentence  # oneDNN held to AVX2 emulates bf16
    assert "limited for both sides by `ATEN_CPU_CAPABILITY=avx2`, `ONEDNN_MAX_CPU_ISA=AVX2`" in sentence


def test_memory_peak_lists_what_is_live_at_the_largest_total():
    """A hand-made trace: 100 + 50 bytes live, 100 freed, then 80 + 40 allocated -> the peak is 170 (50 + 80 + 40),
    reached at the last allocation; a free of a block allocated before recording began changes nothing; each block
    is charged to its innermost grouprl frame."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "gpu"))
    import memory_peak

    def frames(line: int) -> list[dict]:
        return [
            {"filename": "/usr/lib/python3/torch/nn/functional.py", "line": 1, "name": "linear"},
            {"filename": "/repo/src/grouprl/model/forward.py", "line": line, "name": "f"},
            {"filename": "/repo/src/grouprl/train/loop.py", "line": 9, "name": "g"},
        ]

    trace = [
        {"action": "alloc", "addr": 1, "size": 100, "frames": frames(10)},
        {"action": "alloc", "addr": 2, "size": 50, "frames": frames(20)},
        {"action": "free_completed", "addr": 99, "size": 500, "frames": []},  # allocated before recording
        {"action": "free_requested", "addr": 1, "size": 100, "frames": []},
        {"action": "free_completed", "addr": 1, "size": 100, "frames": []},
        {"action": "alloc", "addr": 3, "size": 80, "frames": frames(30)},
        {"action": "alloc", "addr": 4, "size": 40, "frames": frames(30)},
        {"action": "free_completed", "addr": 4, "size": 40, "frames": []},
    ]
    peak, live = memory_peak.live_at_peak(trace)
    assert peak == 170 and sorted(live) == [2, 3, 4]
    text = memory_peak.report({"device_traces": [trace], "allocated_before": 3 * 2**30})
    assert "allocated when recording began: 3.00 GiB" in text
    assert text.index("grouprl/model/forward.py:30 f") < text.index("grouprl/model/forward.py:20 f")
    assert "functional.py" not in text and "loop.py" not in text


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="the CPU peak reads Linux's /proc/self")
def test_a_cpu_peak_counts_only_what_was_allocated_after_the_reset():
    """The GPU benchmark's CPU stand-in for peak allocated memory: 200 MB held before the reset is not counted,
    200 MB allocated and freed after it is."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "gpu"))
    import bench_generation

    held = torch.ones(50_000_000)
    start = bench_generation.reset_peak_memory("cpu")
    transient = torch.ones(50_000_000)
    del transient
    peak = bench_generation.peak_memory_gb("cpu", start)
    assert 0.19 < peak < 0.3, peak
    assert held.sum() == 50_000_000


def test_the_plain_training_pass_adds_no_operators_to_a_layer():
    """bench_train_ops: per layer, grouprl's plain pass (forward + backward, gradient checkpointing) dispatches what
    one forward of all rows with full logits does; a packed row's layer dispatches more (its gathers), which is why a
    GPU packs only for a large saving."""
    import bench_train_ops

    def per_layer(name: str) -> tuple[int, int]:
        counts = []
        for layers in (1, 2):
            case = dataclasses.replace(
                bench_train_ops.PLAN[1], prompts=2, generations=4, prompt_tokens=3, shared_prefix=3
            )
            model = bench_train_ops.build_model(layers)
            rows = bench_train_ops.batch(case, 5, model.config.vocab_size)
            bench_train_ops.one_pass("packed", model, rows)  # the packing probe's forwards, once per model
            out = bench_train_ops.one_pass(name, model, rows)
            assert out["layer_recomputations"] == out["model_forwards"]  # each forward's layers recomputed once
            counts.append((out["forward_operators"], out["backward_operators"]))
        return counts[1][0] - counts[0][0], counts[1][1] - counts[0][1]

    plain, naive, packed = per_layer("plain"), per_layer("naive"), per_layer("packed")
    assert plain == naive
    assert packed[0] > plain[0] and packed[1] > plain[1]


def test_a_decode_layer_under_bf16_autocast_casts_only_the_products_inputs():
    """bench_decode_ops: fp32 weights under bf16 autocast (bf16=True), a decode layer's only dtype changes are the two
    normed inputs of its stacked products (qkv, gate/up); RoPE writes bf16 itself, the cache and attention are bf16
    and the residual adds promote. Before, RoPE's input, the cache writes and both residual adds cast too (7). RoPE
    overwrites the product's q and k, so keys and values reach the cache in one write (two before)."""
    import bench_decode_ops

    def per_layer(autocast: bool):
        one, two = (bench_decode_ops.step_operators(n, torch.float32, 8, "cpu", autocast, "tiny") for n in (1, 2))
        return {op: two[op] - one[op] for op in set(one) | set(two) if two[op] != one[op]}

    layer = per_layer(autocast=True)
    assert layer["_to_copy"] == 2
    assert layer["_scaled_dot_product_flash_attention_for_cpu"] == 1 and layer["index_copy_"] == 1
    assert "clone" not in layer  # attention reads the cache's strided halves as they are
    assert "_to_copy" not in per_layer(autocast=False)  # fp32 end to end: nothing to cast


def test_the_decode_attention_ways_compute_the_loops_attention():
    """bench_decode_attention.py times each way only after checking it against the loop's own `attend`."""
    import bench_decode_attention as bench

    torch.manual_seed(0)
    cache = bench.build_cache(layers=2, rows=6, kv_heads=2, columns=48, dim=32, device="cpu")
    query = torch.randn(6, 8, 1, 32, dtype=torch.bfloat16)
    expected = cache.layer(1).attend(query, 32**-0.5).float()
    for name in ("sdpa:math", "products"):
        got = bench.way(name)(cache, 1, query, 32**-0.5).float()
        torch.testing.assert_close(got, expected, rtol=0, atol=2e-2)
    masked = cache.bias[:, 0, 0] == float("-inf")  # padding and columns not yet written
    assert bool(masked[::3, :5].all()) and bool(masked[:, 36:].all()) and not bool(masked[1:3, :36].any())
