#!/usr/bin/env bash
# Run a command on the device image with the wheels it lacks: `bash bench/with_wheels.sh python3 -m bench.x ...`
#   bash bench/with_wheels.sh python3 -m bench.mtp_gpu_check --out-dir $OUT
# .whl holds pydantic, fastapi, uvicorn, httptools, llguidance and their dependencies (see bench/serve_gpu.sh)
# and glmc's own wheel,
# built here from the tree being measured: `pip wheel --no-deps --no-build-isolation -w .whl . &&
# git describe --always --dirty > .whl/COMMIT` (the device copy has no .git; GLMC_COMMIT is exported from it).
set -u
ls .whl/glmc-*.whl >/dev/null 2>&1 || { echo "no glmc wheel in .whl: pip wheel --no-deps --no-build-isolation -w .whl ."; exit 3; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 3
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
export GLMC_COMMIT=${GLMC_COMMIT:-$(cat .whl/COMMIT 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
exec "$@"
