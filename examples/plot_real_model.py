"""Side-by-side table and reward curves of examples/real_model_smollm2.py runs (grouprl and TRL).

    python examples/plot_real_model.py RUN_DIR [RUN_DIR ...] --plot docs/real_model_reward_curves.png

Each RUN_DIR holds the summary.json a run wrote. Prints a markdown table (held-out accuracy and
format before/after, training seconds, seconds per step, load average at the end) and draws every
run's per-step mean reward on one plot, grouprl solid and TRL dashed.
"""

from __future__ import annotations

import argparse
import json
import os


def load(run_dirs: list[str]) -> list[dict]:
    runs = []
    for path in run_dirs:
        with open(os.path.join(path, "summary.json")) as handle:
            runs.append(json.load(handle))
    return sorted(runs, key=lambda r: (r["mode"], r["seed"], r["library"] != "grouprl"))


def table(runs: list[dict]) -> str:
    lines = [
        "| library | mode | seed | steps | held-out accuracy before -> after (gain) | format before -> after | train s "
        "| s/step | load avg (1 min) at end |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        gain = r["accuracy_after"] - r["accuracy_before"]
        lines.append(
            f"| {r['library']} | {r['mode']} | {r['seed']} | {r['steps']} | {r['accuracy_before']:.3f} -> "
            f"{r['accuracy_after']:.3f} ({gain:+.3f}) | {r['format_before']:.3f} -> {r['format_after']:.3f} | "
            f"{r['train_seconds']:.0f} | {r['seconds_per_step']:.1f} | {r['load_average'][0]:.1f} |"
        )
    return "\n".join(lines)


def comparison(runs: list[dict]) -> str:
    """Per mode: each library's mean held-out gain and training seconds over its seeds, and grouprl's ratios."""
    lines = [
        "| mode | seeds | grouprl mean gain | TRL mean gain | grouprl mean train s | TRL mean train s | "
        "grouprl wall-clock / TRL |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode in sorted({r["mode"] for r in runs}):
        by_library = {
            library: [r for r in runs if r["mode"] == mode and r["library"] == library]
            for library in ("grouprl", "trl")
        }
        if not all(by_library.values()):
            continue
        gain = {k: sum(r["accuracy_after"] - r["accuracy_before"] for r in v) / len(v) for k, v in by_library.items()}
        seconds = {k: sum(r["train_seconds"] for r in v) / len(v) for k, v in by_library.items()}
        seeds = sorted({r["seed"] for v in by_library.values() for r in v})
        lines.append(
            f"| {mode} | {', '.join(map(str, seeds))} | {gain['grouprl']:+.3f} | {gain['trl']:+.3f} | "
            f"{seconds['grouprl']:.0f} | {seconds['trl']:.0f} | {seconds['grouprl'] / seconds['trl']:.2f} |"
        )
    return "\n".join(lines)


def plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    colours = {}
    for r in runs:
        key = (r["mode"], r["seed"])
        colour = colours.setdefault(key, f"C{len(colours)}")
        steps = [h["step"] for h in r["history"]]
        axis.plot(
            steps,
            [h["reward"] for h in r["history"]],
            color=colour,
            linestyle="-" if r["library"] == "grouprl" else "--",
            label=f"{r['library']} {r['mode']} seed {r['seed']}",
        )
    axis.set(
        xlabel="optimizer step",
        ylabel="mean reward (answer + format)",
        title="SmolLM2-135M-Instruct, tagged addition: grouprl vs TRL 1.16",
    )
    axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    runs = load(args.runs)
    print(table(runs))
    print()
    print(comparison(runs))
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
