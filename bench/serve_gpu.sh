#!/usr/bin/env bash
# The serving benchmark on one H200, from the repository root, within ~10 minutes
# (bench/serve_gpu.py says what runs):  bash bench/serve_gpu.sh
# .whl holds the wheels the image lacks (pydantic, pydantic-core, annotated-types, typing-inspection,
# typing-extensions, fastapi, starlette, uvicorn, httptools, annotated-doc, opentelemetry-api, llguidance:
# cp312 manylinux wheels, `pip download --no-deps --only-binary=:all: --python-version 3.12 ...`) and glmc's own,
# built here just before from the tree being measured: `pip wheel --no-deps --no-build-isolation -w .whl .`.
# BUDGET (s, default 540) bounds serve_gpu.py; with the install before it the call ends well inside 600 s.
# The commit recorded: $GLMC_COMMIT, else .whl/COMMIT (write it with the wheel: `git describe --always
# --dirty > .whl/COMMIT`; the device copy has no .git).
set -u
OUT=${OUT:-/tmp/serve_gpu_out}
mkdir -p "$OUT"
bash "$(dirname "$0")/with_wheels.sh" python3 -m bench.serve_gpu --out-dir "$OUT" --budget "${BUDGET:-540}" 2>&1 \
    | tee "$OUT/serve_gpu.log"
