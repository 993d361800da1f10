#!/usr/bin/env bash
# Session 52's device calls (issue 73 hybrid decoding / 32K rows / memory plan, issue 74 FP8),
# each step under its own timeout, logs in $OUT. Carry .whl/gput (bash dev/gpu/carry.sh gpu).
#   bash dev/gpu/s52_session.sh a    # hybrid decode bench, 27B hybrid at 8192 + 32768 rows, gpu tests
#   bash dev/gpu/s52_session.sh b    # 8B-shaped step bf16 vs fp8, the plan on an 80 GB cap
#   bash dev/gpu/s52_session.sh c    # one H100 call: hybrid decode (48 slots), 8B bf16 vs fp8, tests
#   bash dev/gpu/s52_session.sh d    # the short call: gpu tests, FP8 GEMMs, hybrid decode (by card)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/gput/*.whl > "$OUT/pip.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader > "$OUT/gpu.txt"
step() {  # step NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0))s"
  grep -v '^\[transformers\]' "$OUT/$name.log" | grep -E '^\{' | tail -1 | cut -c1-1500
}
mode=${1:-a}
if [ "$mode" = auto ]; then  # by the card that came: H200 (141 GB) a, else c
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
  if [ "$mib" -gt 100000 ]; then mode=a; else mode=c; fi
  echo "auto: $mib MiB -> $mode"
fi
case $mode in
  a)
    step decode 220 python3 bench/hybrid_decode.py
    step rows27b 170 python3 bench/trainer.py --geometry 27b-hybrid --rows 8192,32768 \
      --skip-overlap-off --warmup 1 --iters 3
    step tests 80 python3 -m pytest -q -m gpu tests/model/test_static_hybrid.py \
      tests/model/test_fp8.py tests/model/test_hybrid.py -k "varlen_attention or fused or graphed or fp8 or scaled"
    tail -3 "$OUT/tests.log"
    ;;
  b)
    step bf16_8b 150 python3 bench/trainer.py --rows 8192 --skip-overlap-off --warmup 2 --iters 6
    step fp8_8b 150 python3 bench/trainer.py --rows 8192 --skip-overlap-off --warmup 2 --iters 6 \
      --precision fp8
    step plan80 200 python3 bench/plan.py --geometry 27b-hybrid --gb 80
    ;;
  e)  # the last minutes of the budget: the FP8 GEMMs, the hybrid graph and kernel tests
    step fp8gemm 40 python3 bench/fp8_gemm.py
    step tests 90 python3 -m pytest -q -m gpu tests/model/test_static_hybrid.py
    tail -2 "$OUT/tests.log"
    ;;
  d)
    step fp8gemm 45 python3 bench/fp8_gemm.py
    step tests 80 python3 -m pytest -q -m gpu tests/model/test_static_hybrid.py \
      tests/model/test_fp8.py -k "fused or graphed or fp8"
    tail -2 "$OUT/tests.log"
    mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -n 1)
    slots=128; [ "$mib" -lt 100000 ] && slots=48
    step decode 240 python3 bench/hybrid_decode.py --slots $slots --prompts $slots \
      --tokens 64 --hf-tokens 8 --hf-rows 8 --hf-new 8
    ;;
  c)
    step decode 190 python3 bench/hybrid_decode.py --slots 48 --prompts 96 --hf-rows 16
    step bf16_8b 120 python3 bench/trainer.py --rows 8192 --skip-overlap-off --warmup 2 --iters 4
    step fp8_8b 120 python3 bench/trainer.py --rows 8192 --skip-overlap-off --warmup 2 --iters 4 \
      --precision fp8
    step tests 70 python3 -m pytest -q -m gpu tests/model/test_static_hybrid.py \
      tests/model/test_fp8.py tests/model/test_hybrid.py -k "varlen_attention or fused or graphed or fp8"
    tail -3 "$OUT/tests.log"
    ;;
esac
