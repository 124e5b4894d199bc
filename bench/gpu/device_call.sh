# Sourced from the repository's root by the one-call device scripts (speed_check.sh, decode_steps.sh): $OUT made and
# exported, the GPU named, the carried wheels on the path (carried_wheels.sh), and `part NAME` to mark each part.
OUT="${OUT:-/tmp/grouprl-gpu}"
mkdir -p "$OUT"
export OUT
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
source bench/gpu/carried_wheels.sh
export PYTHONPATH="$PWD/src:${PYTHONPATH:-}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
part() { echo "== $1 ($(date +%T))"; }
