"""Run every benchmark and write docs/benchmarks.md.

    python bench/run_all.py [--trl-python /path/to/trl-venv/bin/python] [--workloads W1 W2 W3 W4] [--repeats N]

With --repeats N each workload runs N times, alternating grouprl and TRL so that both see the same
machine conditions; the table reports each side's median seconds per step, lists every run and the
speed-up of each alternating pair. The matrix-product floor (bench_bounds.py) and the matmul peak are
measured right after each pair too (medians reported): this shared machine's speed drifts by 20-40%
within an hour, so a floor or peak timed at another moment than the runs it is compared with says little.
Only the part of docs/benchmarks.md between the GENERATED markers is rewritten; the analysis
around it is kept.

A full run takes an hour or more. With --record FILE each finished workload's raw measurements are
appended to FILE (one JSON line each); run the same command again and the workloads already in FILE
are read back instead of measured again, so an interrupted run goes on where it stopped.

grouprl runs in this interpreter's environment; TRL 1.16 in a separate one (never a dependency of
grouprl): create it with `python3 -m venv trl-venv && trl-venv/bin/pip install torch==2.13.0 trl==1.16.0`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
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
        return [
            {"error": result.stderr.strip().splitlines()[-1] if result.stderr.strip() else f"exit {result.returncode}"}
        ]
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
    parser.add_argument(
        "--repeats", type=int, default=1, help="Runs per workload and framework, alternating (median reported)."
    )
    parser.add_argument(
        "--dtype", choices=["fp32", "bf16", "auto"], default="fp32", help="Passed to bench_train.py (both sides)."
    )
    parser.add_argument(
        "--record", help="JSON-lines file of finished workloads: appended to, and read back to resume a run."
    )
    args = parser.parse_args()
    recorded = read_record(args.record, args.dtype)
    peaks, rows, bounds = [], [], {}
    for workload in args.workloads:
        if workload in recorded:
            done = recorded[workload]
            print(f"{workload}: read back from {args.record}", flush=True)
        else:
            done = measure(workload, args.repeats, args.dtype, args.trl_python)
            if args.record:
                with open(args.record, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps(done) + "\n")
        peaks += done["peaks"]
        rows.append((workload, median_run(done["ours"]), median_run(done["theirs"])))
        if done["floors"]:
            bounds[workload] = median_floor(done["floors"])
    generation = run_json([sys.executable, "bench/bench_generate.py", "W2"])
    peak = {dtype: statistics.median(p[dtype] for p in peaks) for dtype in peaks[0]}
    write_report(args.output, peak, rows, generation, args.repeats, bounds)
    print(f"wrote {args.output}")


def measure(workload: str, repeats: int, dtype: str, trl_python: str) -> dict:
    """`repeats` alternating grouprl / TRL runs of one workload, each pair followed by the floor and the peak."""
    done = {"workload": workload, "dtype": dtype, "ours": [], "theirs": [], "floors": [], "peaks": []}
    train = ["bench/bench_train.py", "--workload", workload, "--dtype", dtype, "--framework"]
    for _ in range(repeats):
        done["ours"].append(run_json([sys.executable, *train, "grouprl"])[0])
        done["theirs"].append(run_json([trl_python, *train, "trl"])[0])
        bounds = run_json([sys.executable, "bench/bench_bounds.py", workload, "--dtype", dtype])
        done["floors"] += [b for b in bounds if "workload" in b]
        done["peaks"].append(matmul_peak())
        print(workload, *(json.dumps(done[k][-1]) for k in ("ours", "theirs", "peaks")), flush=True)
    return done


def read_record(path: str | None, dtype: str) -> dict[str, dict]:
    """The workloads a previous run with the same --record file finished, by name (the last entry wins)."""
    if not path or not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as handle:
        entries = [json.loads(line) for line in handle if line.strip()]
    other = sorted({e["dtype"] for e in entries} - {dtype})
    if other:
        kinds = ", ".join(other)
        raise SystemExit(f"--record {path} holds {kinds} runs, this run is --dtype {dtype}: use another file")
    return {e["workload"]: e for e in entries}


def median_floor(floors: list[dict]) -> dict:
    """The floor measurement with the median total (its parts stay consistent with each other)."""
    middle = statistics.median(f["floor_seconds_per_step"] for f in floors)
    return dict(min(floors, key=lambda f: abs(f["floor_seconds_per_step"] - middle)), floor_seconds_per_step=middle)


def pair_speedups(ours: dict, theirs: dict) -> list[float]:
    """TRL s/step / grouprl s/step of each alternating pair of runs."""
    return [t / o for o, t in zip(ours.get("runs", []), theirs.get("runs", []))]


def median_run(runs: list[dict]) -> dict:
    """The run whose seconds per step is closest to the median, with the median and every run's value added."""
    timed = [r for r in runs if "seconds_per_step" in r]
    if not timed:
        return runs[0]
    middle = statistics.median(r["seconds_per_step"] for r in timed)
    chosen = dict(min(timed, key=lambda r: abs(r["seconds_per_step"] - middle)))
    chosen["phase_seconds_step"] = chosen["seconds_per_step"]
    rescale = chosen["seconds_per_step"] / middle  # per-second rates follow the median step time
    chosen.update(
        seconds_per_step=middle,
        runs=[r["seconds_per_step"] for r in timed],
        generated_tokens_per_second=chosen["generated_tokens_per_second"] * rescale,
    )
    if "useful_gflops_per_second" in chosen:
        chosen["useful_gflops_per_second"] *= rescale
    return chosen


def fmt(value: object, digits: int = 2) -> str:
    return f"{value:.{digits}f}" if isinstance(value, (int, float)) else str(value)


START, END = "<!-- GENERATED by bench/run_all.py: start -->", "<!-- GENERATED by bench/run_all.py: end -->"


def cpu_sentence(rows: list) -> str:
    """The CPU's flags and the dtype the runs used (both recorded by bench_train.py)."""
    from workloads import cpu_flags, isa_limits, native_bf16

    flags = cpu_flags()
    limits = isa_limits()
    dtypes = sorted(
        {run.get("dtype", "fp32") for _, ours, theirs in rows for run in (ours, theirs) if "dtype" in run}
    ) or ["fp32"]
    native = native_bf16()
    listed = ", ".join(f"{name} {'yes' if present else 'no'}" for name, present in flags.items())
    limited = (
        " Instruction set limited for both sides by "
        + ", ".join(f"`{name}={value}`" for name, value in limits.items())
        + ": PyTorch's, oneDNN's and MKL's kernels ran as on a CPU without the flags above them."
        if limits
        else ""
    )
    return (
        f"CPU flags: {listed}, so bf16 is {'native' if native else 'emulated by PyTorch (~100x slower)'}; "
        f"both sides ran in **{' and '.join(dtypes)}** (`use_cpu=True`).{limited}"
    )


def phase_table(rows: list) -> list[str]:
    """Where grouprl's median run spends a step: its logged time/<phase> seconds, the rest as `other`."""
    phased = [(name, ours) for name, ours, _ in rows if ours.get("phase_seconds")]
    if not phased:
        return []
    phases = sorted({p for _, ours in phased for p in ours["phase_seconds"]})
    lines = [
        "",
        "Where grouprl's step goes (its logged `time/<phase>` seconds per optimizer step, median run; `other`: "
        "the rest of the step: batching, statistics, callbacks):",
        "",
        f"| workload | {' | '.join(phases)} | other | s/step |",
        "|---" * (len(phases) + 3) + "|",
    ]
    for name, ours in phased:
        seconds = [ours["phase_seconds"].get(p, 0.0) for p in phases]
        # the phases of the median run, against that run's own step time (not the median of all runs)
        step = ours["phase_seconds_step"] if "phase_seconds_step" in ours else ours["seconds_per_step"]
        lines.append(f"| {name} | {' | '.join(fmt(v) for v in seconds)} | {fmt(step - sum(seconds))} | {fmt(step)} |")
    return lines


def write_report(
    path: str, peak: dict, rows: list, generation: list[dict], repeats: int, bounds: dict[str, dict]
) -> None:
    from workloads import WORKLOADS

    lines = [
        START,
        f"Measured {datetime.date.today()} on this project's machine: {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, torch threads default, no GPU. Command: `python bench/run_all.py "
        f"{' '.join(sys.argv[1:])}` (grouprl in `.venv`, TRL 1.16.0 in a separate venv; runs alternate between the "
        "two, medians reported). Same model, data, config and seed on both sides; the training script "
        "`bench/bench_train.py` is identical for both frameworks except the import line.",
        "",
        f"Measured matmul peak (1024x1024, median of the measurements after each pair): fp32 {peak['float32']:.1f} "
        f"GFLOP/s, bf16 {peak['bfloat16']:.2f} GFLOP/s. {cpu_sentence(rows)} Useful FLOP/s are reported against the "
        "fp32 peak.",
        "",
        "| workload | what | grouprl s/step | TRL s/step | speed-up | grouprl gen tok/s | TRL gen tok/s | grouprl peak "
        "RSS MiB | TRL peak RSS MiB | memory ratio | grouprl useful GFLOP/s (% of fp32 peak) | runs: grouprl / TRL "
        "s/step | speed-up of each pair |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, ours, theirs in rows:
        speed = (
            theirs.get("seconds_per_step", float("nan")) / ours.get("seconds_per_step", float("nan"))
            if "seconds_per_step" in ours and "seconds_per_step" in theirs
            else "n/a"
        )
        memory = (
            ours["peak_rss_mib"] / theirs["peak_rss_mib"]
            if "peak_rss_mib" in ours and "peak_rss_mib" in theirs
            else "n/a"
        )
        useful = ours.get("useful_gflops_per_second")
        lines.append(
            f"| {name} | {WORKLOADS[name].description} | {fmt(ours.get('seconds_per_step', ours.get('error')))} | "
            f"{fmt(theirs.get('seconds_per_step', theirs.get('error')))} | {fmt(speed)}x | "
            f"{fmt(ours.get('generated_tokens_per_second'), 0)} | {fmt(theirs.get('generated_tokens_per_second'), 0)} "
            f"| {fmt(ours.get('peak_rss_mib'), 0)} | {fmt(theirs.get('peak_rss_mib'), 0)} | {fmt(memory)} | "
            f"{fmt(useful, 1)} ({fmt(100 * useful / peak['float32'], 0) if useful else 'n/a'}%) | "
            f"{', '.join(fmt(v) for v in ours.get('runs', []))} / {', '.join(fmt(v) for v in theirs.get('runs', []))} "
            f"| {', '.join(fmt(v) + 'x' for v in pair_speedups(ours, theirs))} |"
        )
    lines += [
        "",
        "Matrix products alone (`bench/bench_bounds.py`, timed right after each pair, median, in "
        f"{' and '.join(sorted({b.get('dtype', 'float32') for b in bounds.values()})) or 'float32'}): each "
        "workload's prefill, decode and training products timed on their real shapes with nothing else (no "
        "attention, norms, sampling, Python): a floor for any library on this machine, and the largest speed-up "
        "over TRL it leaves.",
        "",
        "| workload | decode products s | training products s | floor s/step | grouprl s/step / floor | TRL s/step / "
        "floor (largest possible speed-up) |",
        "|---|---|---|---|---|---|",
    ]
    for name, ours, theirs in rows:
        b = bounds.get(name)
        if not b:
            continue
        floor = b["floor_seconds_per_step"]
        lines.append(
            f"| {name} | {fmt(b['decode_floor_seconds'])} | "
            f"{fmt(b['train_floor_seconds'] + b['prefill_floor_seconds'])} | {fmt(floor)} | "
            f"{fmt(ours.get('seconds_per_step', float('nan')) / floor)} | "
            f"{fmt(theirs.get('seconds_per_step', float('nan')) / floor)}x |"
        )
    lines += phase_table(rows)
    lines += [
        "",
        "Generation alone (W2: shared ~400-token prompt, 4 prompts x 8 samples, up to 128 new tokens, fp32):",
        "",
        "| backend | seconds | generated tokens | tokens/s |",
        "|---|---|---|---|",
    ]
    for g in generation:
        lines.append(
            f"| {g.get('backend', g.get('error'))} | {fmt(g.get('seconds'))} | {fmt(g.get('generated_tokens'), 0)} | "
            f"{fmt(g.get('tokens_per_second'), 0)} |"
        )
    if len(generation) == 2 and all("tokens_per_second" in g for g in generation):
        lines.append(
            "\nFastGenerator / transformers.generate: "
            f"{generation[1]['tokens_per_second'] / generation[0]['tokens_per_second']:.2f}x tokens/s."
        )
    lines += [
        "",
        "GPU runs (the Qwen2.5-0.5B and 1.5B shapes on an H200) have a page of their own: "
        "[benchmarks-gpu.md](benchmarks-gpu.md).",
        END,
    ]
    text = (
        open(path, encoding="utf-8").read() if os.path.exists(path) else "# Benchmarks\n\n" + START + "\n" + END + "\n"
    )
    if START not in text or END not in text:
        raise SystemExit(
            f"{path} has no {START} ... {END} section to replace; add the two markers where the tables belong."
        )
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(before + "\n".join(lines) + after)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    main()
