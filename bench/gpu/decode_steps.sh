#!/usr/bin/env bash
# One device call for issue 62 (the model's own forward as the captured loop's step), inside ~9 minutes on an
# H100/H200, the deciding measurement first (each part has a time limit):
#   1. decode ms/step of the model's own step (ModelStep) against the hand-written one (FusedDecoder), eager and
#      compiled, for the three rows of fused_step.FAMILIES with a `gpu` column: the 0.5B dense case (1), Gemma 3 (4),
#      Qwen3-MoE (5)
#      (bench_generation.py --decode-steps; first_call_s is the warm-up call, compiles included). A row keeps its
#      `gpu` column where its fused step is >= 1.25x faster (else set it to None, or delete the row with no `cpu`);
#   2. the 0.5B headline: s/step and peak against TRL 1.16's default path, with the default step choice;
#   3. the GPU tests of the captured loop and its steps (check.sh).
# Long completions (128 x 8k new tokens of an 8B shape, in waves) are a second call: bench/gpu/long_completions.py.
# Run from the repository's root there, with .whl carried (bench/gpu/fetch_wheels.sh made it here):
#   bash bench/gpu/decode_steps.sh          # logs and JSON under $OUT (or /tmp/grouprl-gpu)
set -uo pipefail
cd "$(dirname "$0")/../.."
source bench/gpu/device_call.sh
part "decode steps: model vs fused"
BUDGET=220 timeout 260 bash bench/gpu/bench.sh --kinds decode --cases "${CASES:-1,4,5}" \
    --only captured,captured+compile --decode-steps model,fused "$@" || tail -25 "$OUT/bench.log"
mv "$OUT/bench_generation.json" "$OUT/bench_decode_steps.json" 2>/dev/null; rm -f "$OUT/bench.log"
part "0.5B case"
BUDGET=120 timeout 160 bash bench/gpu/bench.sh --kinds train --cases 1 --only trl,captured || tail -25 "$OUT/bench.log"
mv "$OUT/bench_generation.json" "$OUT/bench_case1.json" 2>/dev/null; rm -f "$OUT/bench.log"
part "GPU tests"
LIMIT=100 bash bench/gpu/check.sh tests/test_gpu.py tests/test_static_decode.py tests/test_fused_step.py tests/test_sampler_gap.py 2>&1 | tail -25
rm -f "$OUT/junit.xml"
part "done"
ls "$OUT"
