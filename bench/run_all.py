"""Run every benchmark and write docs/benchmarks.md.

    python bench/run_all.py [--trl-python /path/to/trl-venv/bin/python] [--workloads W1 W2 W3 W4]

grouprl runs in this interpreter's environment; TRL 1.16 in a separate one (never a dependency of
grouprl): create it with `python3 -m venv trl-venv && trl-venv/bin/pip install torch==2.13.0 trl==1.16.0`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run_json(command: list[str]) -> list[dict]:
    print("$", " ".join(command), flush=True)
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
    lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"')]
    if result.returncode != 0 or not lines:
        print(result.stderr[-3000:], file=sys.stderr)
        return [{"error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"exit {result.returncode}"}]
    return lines


def matmul_peak() -> dict[str, float]:
    import torch

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(1024, 1024, dtype=dtype), torch.randn(1024, 1024, dtype=dtype)
        a @ b
        start, reps = time.perf_counter(), 3 if dtype == torch.bfloat16 else 20
        for _ in range(reps):
            a @ b
        out[str(dtype).replace("torch.", "")] = reps * 2 * 1024**3 / (time.perf_counter() - start) / 1e9
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trl-python", default=os.path.join(ROOT, "..", "trl-venv", "bin", "python"))
    parser.add_argument("--workloads", nargs="+", default=["W1", "W2", "W3", "W4"])
    parser.add_argument("--output", default=os.path.join(ROOT, "docs", "benchmarks.md"))
    args = parser.parse_args()
    peak = matmul_peak()
    rows = []
    for workload in args.workloads:
        ours = run_json([sys.executable, "bench/bench_train.py", "--framework", "grouprl", "--workload", workload])[0]
        theirs = run_json([args.trl_python, "bench/bench_train.py", "--framework", "trl", "--workload", workload])[0]
        rows.append((workload, ours, theirs))
        print(workload, json.dumps(ours), json.dumps(theirs), flush=True)
    generation = run_json([sys.executable, "bench/bench_generate.py", "W2"])
    write_report(args.output, peak, rows, generation)
    print(f"wrote {args.output}")


def fmt(value: object, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else str(value)


def write_report(path: str, peak: dict, rows: list, generation: list[dict]) -> None:
    from workloads import WORKLOADS

    lines = [
        "# Benchmarks",
        "",
        f"Measured {datetime.date.today()} on this project's machine: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch threads default, no GPU. Command: `python bench/run_all.py` (grouprl in `.venv`, "
        "TRL 1.16.0 in a separate venv). Same model, data, config and seed on both sides; the training script "
        "`bench/bench_train.py` is identical for both frameworks except the import line.",
        "",
        f"Measured matmul peak (1024x1024): fp32 {peak['float32']:.1f} GFLOP/s, bf16 {peak['bfloat16']:.2f} GFLOP/s. This CPU "
        "has AVX2 but no AVX512-BF16/AMX, so PyTorch emulates bf16; both sides therefore run in **fp32** "
        "(`bf16=False, use_cpu=True`), and useful FLOP/s are reported against the fp32 peak.",
        "",
        "| workload | what | grouprl s/step | TRL s/step | speed-up | grouprl gen tok/s | TRL gen tok/s | grouprl peak RSS MiB | TRL peak RSS MiB | memory ratio | grouprl useful GFLOP/s (% of fp32 peak) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, ours, theirs in rows:
        speed = theirs.get("seconds_per_step", float("nan")) / ours.get("seconds_per_step", float("nan")) if "seconds_per_step" in ours and "seconds_per_step" in theirs else "n/a"
        memory = ours["peak_rss_mib"] / theirs["peak_rss_mib"] if "peak_rss_mib" in ours and "peak_rss_mib" in theirs else "n/a"
        useful = ours.get("useful_gflops_per_second")
        lines.append(
            f"| {name} | {WORKLOADS[name].description} | {fmt(ours.get('seconds_per_step', ours.get('error')))} | "
            f"{fmt(theirs.get('seconds_per_step', theirs.get('error')))} | {fmt(speed)}x | {fmt(ours.get('generated_tokens_per_second'), 0)} | "
            f"{fmt(theirs.get('generated_tokens_per_second'), 0)} | {fmt(ours.get('peak_rss_mib'), 0)} | {fmt(theirs.get('peak_rss_mib'), 0)} | "
            f"{fmt(memory)} | {fmt(useful, 1)} ({fmt(100 * useful / peak['float32'], 0) if useful else 'n/a'}%) |"
        )
    lines += ["", "Generation alone (W2: shared ~400-token prompt, 4 prompts x 8 samples, up to 128 new tokens, fp32):", "",
              "| backend | seconds | generated tokens | tokens/s |", "|---|---|---|---|"]
    for g in generation:
        lines.append(f"| {g.get('backend', g.get('error'))} | {fmt(g.get('seconds'))} | {fmt(g.get('generated_tokens'), 0)} | {fmt(g.get('tokens_per_second'), 0)} |")
    if len(generation) == 2 and all("tokens_per_second" in g for g in generation):
        lines.append(f"\nFastGenerator / transformers.generate: {generation[1]['tokens_per_second'] / generation[0]['tokens_per_second']:.2f}x tokens/s.")
    lines += ["", "No GPU machine was available for this task, so there are no GPU rows (Qwen2.5-0.5B-shaped model) yet.", ""]
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(lines))


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
