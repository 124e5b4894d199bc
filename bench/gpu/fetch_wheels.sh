#!/usr/bin/env bash
# Download, here (where PyPI is reachable), the wheels that a fresh GPU machine without network lacks for the
# suite's GPU part: into .whl/ at the repository's root, for the GPU image's Python (3.12, x86-64 manylinux).
# The image already has torch, transformers, accelerate, peft, pytest, pytest-xdist, pytest-timeout, pyarrow, pandas
# (bench/gpu/README.md). About 48 MiB in all (bitsandbytes 43), inside the 64 MiB a device call may carry.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
PACKAGES=(
    datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
    gguf==0.19.0 math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
    fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
    typing-inspection==0.4.5 uvicorn==0.54.0 bitsandbytes==0.50.2
    trl==1.16.0  # bench/gpu/bench_generation.py runs TRL beside grouprl; the package never imports it
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${PACKAGES[@]}"
du -sh .whl && ls .whl
