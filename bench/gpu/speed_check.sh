#!/usr/bin/env bash
# One device call for the generation-speed work (docs/benchmarks-gpu.md), inside ~10 minutes on an H100/H200,
# the most wanted first (each part has a time limit, so one that hangs leaves the rest their time):
#   1. the 0.5B case through TRL 1.16, grouprl's captured loop and the captured loop with its step compiled:
#      s/step, decode ms/step, kernels per decode step, peak memory (bench.sh, at most 200 s; 134 s on the H200);
#   2. the decode step alone, as the trainer generates (fp32 weights under bf16 autocast), as it is, with its MLP in
#      the row-major orientation it had before, and compiled: ms and kernels a step, peak memory
#      (bench/bench_decode_step.py, at most 80 s): whether W @ x^T pays on CUDA (fused_step.mlp_transposed_pays_off)
#      and whether compile_decode_step should become the default;
#   3. the decode step's draw alone, by each sampling method, replayed from a graph (bench/bench_sampling.py, at most
#      20 s): the two-level inverse CDF against multinomial's exponential race;
#   4. the GPU tests of the captured loop, its compiled step and its families (check.sh, at most 120 s);
#   5. the Qwen3.5 0.8B layout (linear attention) through TRL 1.16 and the captured loop (at most 90 s);
#   6. one step of the captured 0.5B case under torch.profiler: kernels by GPU time, and what holds memory at its
#      peak (profile_step.py --memory, at most 70 s).
# The device tool returns at most 8 files from $OUT: the parts' extra files (junit.xml, the memory snapshot, the
# benchmark's log, whose result lines this log holds) are removed or moved to /tmp.
# Run from the repository's root there, with .whl carried (bench/gpu/fetch_wheels.sh made it here):
#   bash bench/gpu/speed_check.sh          # logs and JSON under $OUT (or /tmp/grouprl-gpu)
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/gpu/device_call.sh
part "0.5B case"
BUDGET=160 timeout 200 bash bench/gpu/bench.sh --cases 1 --only trl,captured,captured+compile || tail -25 "$OUT/bench.log"
mv "$OUT/bench_generation.json" "$OUT/bench_case1.json" 2>/dev/null; rm -f "$OUT/bench.log"
part "decode step"
timeout 80 python3 bench/bench_decode_step.py 2>&1 | tee "$OUT/decode_step.jsonl" | grep '"way"'
part "draw"
timeout 20 python3 bench/bench_sampling.py 2>&1 | tee "$OUT/sampling.json" | grep '"method"'
part "GPU tests"
LIMIT=120 bash bench/gpu/check.sh tests/test_gpu.py tests/test_static_decode.py tests/test_fused_step.py 2>&1 | tail -25
rm -f "$OUT/junit.xml"
part "Qwen3.5 case"
BUDGET=60 timeout 90 bash bench/gpu/bench.sh --cases 6 --only trl,captured || tail -25 "$OUT/bench.log"
mv "$OUT/bench_generation.json" "$OUT/bench_case6.json" 2>/dev/null; rm -f "$OUT/bench.log"
part "profiled step"
timeout 70 python3 bench/gpu/profile_step.py --case 1 --memory --rows 25 --out "$OUT/profile_step.txt" 2>&1 \
    | grep -v "^\s*$" | tail -45
mv "$OUT"/*.memory.pickle.gz /tmp/ 2>/dev/null
part "done"
ls "$OUT"
