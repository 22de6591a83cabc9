#!/usr/bin/env bash
# The two-GPU jobs on a host with two H200s, from the repository root: the multi-GPU checks, then
# the one-GPU plan check, within ~10 minutes:  bash bench/device_x2.sh
# .whl holds the wheels the GPU image lacks, for Python 3.12 manylinux:
# pydantic, pydantic-core, annotated-types, typing-inspection, fastapi, starlette, uvicorn,
# annotated-doc, opentelemetry-api, and for the serving check's openai client openai, jiter,
# httpx2, httpcore2, truststore, sniffio, anyio, idna. glmc itself is installed from this tree.
# JOBS picks what runs: calibrate (bench/calibrate.py), multi (bench/multi_gpu_check.py), multi_fp8
# (its tiny check on a block-FP8 checkpoint, kept FP8 on both GPUs), spec
# (spec_bench.py: decode per spec at batch 1/32/128 per rank), plan
# (gpu_plan_check.py), serve (serve_multi_gpu.py, SERVE_ARGS="--only tp2"), decode (decode_bench.py),
# p2p (p2p_bench.py: the one-shot peer-memory kernels against NCCL, and replay stability),
# full (full_model.py: GLM-5.3's width and as many layers as fit, random FP8 weights, FULL_ARGS);
# default: multi plan. With a calibration (the newest in $OUT or bench/results, or $CALIBRATION),
# multi and decode print each step predicted next to measured (~7 min in all):
#   JOBS="calibrate multi decode" DECODE_ARGS="--skip eager,compile" bash bench/device_x2.sh
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .whl/*.whl || exit 3
python3 -m pip install -q --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 4
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 \
    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/device_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nvidia-smi topo -m | head -4
git log -1 --format='commit %H' 2>/dev/null || true
for job in ${JOBS:-multi plan}; do
  CAL=${CALIBRATION:-$(ls -t "$OUT"/calibration_*.json bench/results/calibration_nvidia-*.json 2>/dev/null | head -1)}
  case $job in
    calibrate) timeout 300 python3 -m bench.calibrate --out-dir "$OUT" > "$OUT/calibrate.log" 2>&1
           echo "calibrate rc=$?"; tail -45 "$OUT/calibrate.log" ;;
    multi) timeout 420 python3 -m bench.multi_gpu_check --out "$OUT/multi_gpu_check.json" ${MULTI_ARGS:-} \
             ${CAL:+--calibration "$CAL"} > "$OUT/multi.log" 2>&1; echo "multi rc=$?"
           grep -E '^\{|CHECK|PREDICTED|Error|error' "$OUT/multi.log" | cut -c1-600 | tail -30 ;;
    multi_fp8) timeout 300 python3 -m bench.multi_gpu_check --fp8 --skip-width --out "$OUT/multi_gpu_check_fp8.json" \
             > "$OUT/multi_fp8.log" 2>&1; echo "multi_fp8 rc=$?"
           grep -E '^\{|CHECK|Error|error' "$OUT/multi_fp8.log" | cut -c1-600 | tail -8 ;;
    spec)  timeout 560 python3 -m bench.spec_bench --out-dir "$OUT" ${CAL:+--calibration "$CAL"} ${SPEC_ARGS:-} \
             > "$OUT/spec.log" 2>&1; echo "spec rc=$?"; grep -E 'PREDICTED|ERROR|^spec|^device' "$OUT/spec.log"
           grep -A20 '^spec ' "$OUT/spec.log" | tail -18 ;;
    plan)  timeout 300 python3 -m bench.gpu_plan_check --out "$OUT/gpu_plan_check.json" > "$OUT/plan.log" 2>&1
           echo "plan rc=$?"; grep -E 'PLAN CHECK|Error' "$OUT/plan.log" | tail -5 ;;
    serve) timeout 400 python3 -m bench.serve_multi_gpu --out "$OUT/serve_multi_gpu.json" ${SERVE_ARGS:-} > "$OUT/serve.log" 2>&1
           echo "serve rc=$?"; grep -E '^\{|SERVE' "$OUT/serve.log" | cut -c1-400 | tail -8 ;;
    p2p)   timeout 300 python3 -m bench.p2p_bench --out "$OUT/p2p_bench.json" > "$OUT/p2p.log" 2>&1
           echo "p2p rc=$?"; grep -A12 -E '^P2P BENCH' "$OUT/p2p.log"; grep -E 'STABILITY|Error' "$OUT/p2p.log" | cut -c1-600 ;;
    full)  timeout 560 python3 -m bench.full_model --out-dir "$OUT" ${CAL:+--calibration "$CAL"} \
             ${FULL_ARGS:---concurrency 1,16,64 --reps 10} > "$OUT/full.log" 2>&1
           echo "full rc=$?"; grep -A30 '^spec ' "$OUT/full.log"; grep -E 'FAILED|Error' "$OUT/full.log" | cut -c1-600 ;;
    decode) timeout 480 python3 -m bench.decode_bench --out-dir "$OUT" ${CAL:+--calibration "$CAL"} ${DECODE_ARGS:-} \
             > "$OUT/decode.log" 2>&1
           echo "decode rc=$?"; grep PREDICTED "$OUT/decode.log"; tail -25 "$OUT/decode.log" ;;
  esac
done
