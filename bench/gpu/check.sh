#!/usr/bin/env bash
# The suite's GPU-relevant part on a fresh H100/H200 machine without network, inside 8 minutes (bench/gpu/README.md).
# Run from the repository's root there, with .whl/ carried (bench/gpu/fetch_wheels.sh made it here):
#   bash bench/gpu/check.sh        # writes pytest.log, junit.xml and summary.txt under $OUT (or /tmp/grouprl-gpu)
#   bash bench/gpu/check.sh tests/test_gpu.py    # only these files; LIMIT=seconds stops pytest sooner (450)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-/tmp/grouprl-gpu}"
mkdir -p "$OUT"
source bench/gpu/carried_wheels.sh
export PYTHONPATH="$PWD/src:$PWD/tests:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 - <<'PY' || exit 1
import importlib
import os
import torch
if os.environ.get("REQUIRE_CUDA", "1") == "1":
    assert torch.cuda.is_available(), "check.sh: torch sees no CUDA device (REQUIRE_CUDA=0 runs it anyway)"
versions = {}
for name in ("torch", "transformers", "accelerate", "peft", "datasets", "bitsandbytes", "grouprl"):
    try:
        versions[name] = getattr(importlib.import_module(name), "__version__", "?")
    except Exception as err:  # a missing package is reported, and its tests skip with the reason
        versions[name] = f"missing ({type(err).__name__}: {err})"
device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA device"
print("check.sh:", device, "|", ", ".join(f"{k} {v}" for k, v in versions.items()))
PY
# Every test file that trains, generates or runs a model: each runs on the device the trainer picks.
FILES=(
    tests/test_gpu.py tests/test_trainer.py tests/test_objectives_e2e.py tests/test_logprobs.py
    tests/test_shared_prompt_training.py tests/test_health.py tests/test_engine.py tests/test_generation_paths.py
    tests/test_fused_step.py tests/test_packed_attention.py tests/test_kv_buffers.py
    tests/test_shared_prefix_probe.py tests/test_evaluation.py tests/test_gfpo.py tests/test_learning.py
    tests/test_checkpoint.py tests/test_weights.py tests/test_qlora.py tests/test_sampling.py tests/test_losses.py
    tests/test_combinations.py tests/test_reward_models.py tests/test_callbacks.py tests/test_trainer_surface.py
    tests/test_cpu_capabilities.py tests/test_decode_products.py tests/test_static_decode.py
)
[ "$#" -gt 0 ] && FILES=("$@")
LIMIT="${LIMIT:-450}"
start=$(date +%s)
timeout "$LIMIT" python3 -m pytest -n "${WORKERS:-14}" -p no:cacheprovider --timeout 300 -m "not slow" -v -rfEs \
    --junitxml "$OUT/junit.xml" "${FILES[@]}" > "$OUT/pytest.log" 2>&1
status=$?
echo "check.sh: pytest exit $status after $(( $(date +%s) - start )) s (124: stopped at the $LIMIT s limit)"
python3 bench/gpu/summarize.py "$OUT/junit.xml" "$OUT/pytest.log" | tee "$OUT/summary.txt"
exit $status
