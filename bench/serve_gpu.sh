#!/usr/bin/env bash
# Serving on the H200 in one device call (bench/serve_gpu.py says what runs):
#   run(command="bash bench/serve_gpu.sh", carry=[".whl"], timeout_s=470)
# .whl holds the wheels the image lacks (pydantic, pydantic-core, annotated-types, typing-inspection,
# typing-extensions, fastapi, starlette, uvicorn, annotated-doc, opentelemetry-api) and glmc's own,
# built here just before: `pip wheel --no-deps --no-build-isolation -w .whl .`.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/serve_gpu_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 "$PWD/bench/serve_gpu.py" --out-dir "$OUT" --budget "${BUDGET:-400}" 2>&1 | tee "$OUT/serve_gpu.log"
