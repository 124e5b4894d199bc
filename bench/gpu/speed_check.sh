#!/usr/bin/env bash
# One device call for the generation-speed work (docs/benchmarks-gpu.md), inside ~9 minutes on an H100/H200:
#   1. the GPU tests of the captured loop, its compiled step included, and its families (Gemma 3 and sliding windows
#      since 2026-11-29) against generate (check.sh, at most 120 s; 66 s on the H200 before the families);
#   2. the decode step alone, as the trainer generates (fp32 weights under bf16 autocast), as it is, with its MLP in
#      the row-major orientation it had before, and compiled: ms and kernels a step, peak memory
#      (bench/bench_decode_step.py, at most 80 s): whether W @ x^T pays on CUDA (fused_decode.mlp_transposed_pays_off)
#      and whether compile_decode_step should become the default;
#   3. the decode step's draw alone, by each sampling method, replayed from a graph (bench/bench_sampling.py, at most
#      20 s): the two-level inverse CDF (since the 2026-11-27 H200 run) against multinomial's exponential race;
#      and the decode step's attention by each way (bench/bench_decode_attention.py, at most 30 s): which kernel the
#      loop's attention should take (cuDNN's took 11.4 us a layer on an H200);
#   4. the 0.5B case through TRL 1.16, grouprl's captured loop and the captured loop with its step compiled:
#      s/step, decode ms/step, kernels per decode step, peak memory (bench.sh, at most 200 s; 134 s on the H200);
#   5. the training pass alone at the 0.5B shape, both cases, packed (one row of all packs, sdpa's kernel: the GPU's
#      defaults since that run) / plain / naive, packed in rows of 8,192 tokens and packed by explicit products:
#      operators, seconds, peak memory (bench/bench_train_ops.py, at most 90 s): whether packing pays on the GPU
#      (prompt_packing.worth_packing), its rows' cap there (row_token_cap), which attention it should take there
#      (packed_attention._explicit_products_pay_off);
#   6. one step of the captured 0.5B case under torch.profiler: kernels by GPU time, and what holds memory at its
#      peak (profile_step.py --memory, at most 70 s).
# Run from the repository's root there, with .whl carried (bench/gpu/fetch_wheels.sh made it here):
#   bash bench/gpu/speed_check.sh          # logs and JSON under $OUT (or /tmp/grouprl-gpu)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/grouprl-gpu}"
mkdir -p "$OUT"
export OUT
LIMIT=120 bash bench/gpu/check.sh tests/test_gpu.py tests/test_static_decode.py tests/test_fused_decode.py 2>&1 | tail -15
# check.sh installed the carried wheels (grouprl imports datasets)
export PYTHONPATH="$PWD/src:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
timeout 80 python3 bench/bench_decode_step.py 2>&1 | tee "$OUT/decode_step.jsonl" | grep '"way"'
timeout 20 python3 bench/bench_sampling.py 2>&1 | tee "$OUT/sampling.json" | grep '"method"'
timeout 30 python3 bench/bench_decode_attention.py 2>&1 | tee "$OUT/decode_attention.json" | grep '"way"'
BUDGET=160 timeout 200 bash bench/gpu/bench.sh --cases 1 --only trl,captured,captured+compile
timeout 90 python3 bench/bench_train_ops.py --width real --device cuda --cases 1,2 --repeat 2 --row-tokens 8192 --explicit-products 2>&1 \
    | tee "$OUT/train_ops.json" | grep -E '"(case|packed.*|plain|naive|model_forwards|median_seconds|peak_gpu_memory_gb)"'
timeout 70 python3 bench/gpu/profile_step.py --case 1 --memory --rows 25 --out "$OUT/profile_step.txt" 2>&1 \
    | grep -v "^\s*$" | tail -45
