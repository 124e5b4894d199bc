#!/usr/bin/env bash
# The GPU benchmark (docs/benchmarks-gpu.md) on a fresh H100/H200 machine without network, inside ~8 minutes.
# Run from the repository's root there, with .whl carried (bench/gpu/fetch_wheels.sh made it here):
#   bash bench/gpu/bench.sh        # writes bench_generation.json and bench.log under $OUT (or /tmp/grouprl-gpu)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/grouprl-gpu}"
mkdir -p "$OUT"
source bench/gpu/carried_wheels.sh
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 480 python3 bench/gpu/bench_generation.py --budget "${BUDGET:-400}" --out "$OUT/bench_generation.json" "$@" \
    2>&1 | tee "$OUT/bench.log" | grep -v "^\s*$" | tail -40
