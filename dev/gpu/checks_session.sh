#!/usr/bin/env bash
# Short GPU checks that ride along the first call of a quality session (dev/gpu/quality_session.sh
# `one` only installs wheels and unpacks prompts; the GPU is idle meanwhile). Device tool `run`,
# kind nvidia-h200, e.g. with carry [".whl/smol", ".whl/fla", ".gguf/partaa", ".qcarry"]:
#   bash dev/gpu/quality_session.sh one && bash dev/gpu/checks_session.sh generate hybrid
# Stages (each bounded by its own timeout; logs in $OUT):
#   generate  issue 17: static-slot generation, synthetic SmolLM2-shaped target, prompts of
#             200..1200 tokens (the reference run's lengths), 192 new tokens: attention
#             lengths in powers of two vs the 128/192 ladder, 256 vs 512 slots, sdpa vs flex
#             (each slot reads its own K/V blocks), and a profile
#             (2026-12-01: the profile of 512 prompts overran its 100 s; give it fewer)
#   smol      issue 17: the SmolLM2-shaped online step at 8192- vs 32768-token rows
#   hybrid    issue 20: the GPU tests of the hybrid (fla varlen) path and of the graphed
#             decoders, then the Qwen3.6-27B-shaped bench against its dense stand-in
#   cold      issue 17: the cold first step of the SmolLM2-shaped run (first on a fresh
#             machine), the target compiled per layer and as one stack, side by side (8 cores
#             each, own inductor caches), with dynamo's compile-time account
#   warm      the SmolLM2-shaped step, warm (the `cold` layers cache), with a kernel profile
#   stacked   the same step with R = 2 and 4 rows per forward (optim.rows_per_forward)
#   gen       static-slot generation at 512 slots: sdpa / flex decode steps, eager / compiled
#             dense layer parts, with the phase split (prefill, decode ms per step)
#   varlen    the same step at R = 4 with the target's attention as varlen flash attention
#             (target.attn_implementation = "varlen") and as flex (the default), each cold
#   muon      the same step (R = 1) with fused AdamW and with flashdraft's Muon, each with a
#             kernel profile (the first cold: ~4 min; the second warm)
# Wheels for `hybrid`: `bash dev/gpu/fla_wheels.sh` (fla-core, einops) into .whl/fla.
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
export FLASHDRAFT_COMMIT=${FLASHDRAFT_COMMIT:-unknown} FLASHDRAFT_CACHE=/tmp/flashdraft-cache
PIP="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"

step() {  # step NAME SECONDS COMMAND...: one bounded step, its log in $OUT/NAME.txt
  local name=$1 seconds=$2
  shift 2
  timeout "$seconds" "$@" > "$OUT/$name.txt" 2>&1
  echo "== $name exit $?"
  grep -v "Loading weights" "$OUT/$name.txt" | tail -n "${TAIL:-25}"
}

for stage in "$@"; do
  case $stage in
  generate)
    common=(--synthetic --backends static --prompts 2048 --prompt-lengths 200,1200
      --max-new-tokens 192)
    step gen_pow2_256 90 python3 bench/generate.py "${common[@]}" --batch-size 256
    step gen_ladder256 90 python3 bench/generate.py "${common[@]}" --batch-size 256 --buckets ladder
    step gen_pow2_512 90 python3 bench/generate.py "${common[@]}" --batch-size 512
    step gen_flex_256 120 python3 bench/generate.py "${common[@]}" --batch-size 256 --attention flex
    step gen_flex_512 120 python3 bench/generate.py "${common[@]}" --batch-size 512 --attention flex
    TAIL=45 step gen_profile 100 python3 bench/generate.py --synthetic --backends static \
      --prompts 128 --prompt-lengths 200,1200 --max-new-tokens 192 --batch-size 128 --profile
    ;;
  smol)
    # issue 17's online step: SmolLM2-135M-shaped target + 3-layer drafter, 8192-token rows
    # (the goal's shape) against 32768-token rows with 4x the anchors: whether more tokens
    # per step (what R > 1 rows per micro-batch would give) lifts tokens/s
    shape=(--hidden 576 --intermediate 1536 --heads 9 --kv-heads 3 --head-dim 64
      --target-layers 30 --vocab 49152 --layers 3 --skip-overlap-off --warmup 3 --iters 10)
    TAIL=12 step smol_8192 200 python3 bench/trainer.py "${shape[@]}" --rows 8192 --anchors 512
    TAIL=12 step smol_32768 200 python3 bench/trainer.py "${shape[@]}" --rows 32768 --anchors 2048
    ;;
  hybrid)
    $PIP --target /tmp/site .whl/fla/*.whl || exit 1
    if [ "${HYBRID_TESTS:-1}" = 1 ]; then  # 12 passed on 2026-12-01 (~160 s): HYBRID_TESTS=0 skips
      step gpu_tests 180 python3 -m pytest -q -m gpu -p no:cacheprovider tests/model/test_hybrid.py \
        tests/data/test_fast_inference.py tests/eval/test_fast.py tests/train/test_loss.py \
        tests/model/test_static.py tests/model/test_static_kernels.py
    fi
    TAIL=40 step trainer_27b_hybrid "${BENCH_S:-300}" python3 bench/trainer.py \
      --geometry 27b-hybrid --compare-paths --rows "${ROWS:-8192,16384}" --warmup 2 --iters 6 \
      --skip-overlap-off
    ;;
  cold)
    smol=(--hidden 576 --intermediate 1536 --heads 9 --kv-heads 3 --head-dim 64
      --target-layers 30 --vocab 49152 --layers 3 --rows 8192 --first-step)
    for scope in layers stack; do
      cores=$([ $scope = layers ] && echo 0-7 || echo 8-15)
      TORCHINDUCTOR_CACHE_DIR=/tmp/ic_$scope TORCH_LOGS=recompiles timeout "${COLD_S:-270}" \
        taskset -c "$cores" python3 bench/trainer.py "${smol[@]}" \
        --set target.compile_scope=$scope > "$OUT/cold_$scope.txt" 2>&1 &
    done
    wait
    for scope in layers stack; do
      echo "== cold_$scope"
      grep -E "first step|Recompiling|triggered|guard|async_compile.wait|compile_fx_inner|_compile.compile_inner|bw_compiler|fw_compiler_base|GraphLowering.compile_to_module|Scheduler.codegen|autotune|\"bench\"" \
        "$OUT/cold_$scope.txt" | cut -c1-220 | tail -40
    done
    ;;
  warm)
    export TORCHINDUCTOR_CACHE_DIR=/tmp/ic_layers
    shape=(--hidden 576 --intermediate 1536 --heads 9 --kv-heads 3 --head-dim 64
      --target-layers 30 --vocab 49152 --layers 3 --rows 8192 --skip-overlap-off --warmup 3
      --iters 10 --set target.compile_scope=layers)
    TAIL=50 step warm_r1 150 python3 bench/trainer.py "${shape[@]}" --profile
    ;;
  stacked)
    export TORCHINDUCTOR_CACHE_DIR=/tmp/ic_layers
    shape=(--hidden 576 --intermediate 1536 --heads 9 --kv-heads 3 --head-dim 64
      --target-layers 30 --vocab 49152 --layers 3 --rows 8192 --skip-overlap-off --warmup 3
      --iters 10 --set target.compile_scope=layers)
    for r in ${STACKED_R:-4 2}; do
      TAIL=12 step "stacked_r$r" "${STACKED_S:-200}" python3 bench/trainer.py "${shape[@]}" \
        --rows-per-forward "$r"
    done
    ;;
  train2)
    # R = 4 rows per forward (default inductor config) and R = 1 with inductor's prologue
    # fusion off (does RoPE fused into the flex kernel's loads slow the target's attention?):
    # both cold first steps side by side (8 cores each), then each timed alone, warm.
    shape=(--hidden 576 --intermediate 1536 --heads 9 --kv-heads 3 --head-dim 64
      --target-layers 30 --vocab 49152 --layers 3 --rows 8192 --set target.compile_scope=layers)
    TORCHINDUCTOR_CACHE_DIR=/tmp/ic_r4 timeout 280 taskset -c 0-7 python3 bench/trainer.py \
      "${shape[@]}" --rows-per-forward 4 --first-step > "$OUT/cold_r4.txt" 2>&1 &
    TORCHINDUCTOR_PROLOGUE_FUSION=0 TORCHINDUCTOR_CACHE_DIR=/tmp/ic_np timeout 280 \
      taskset -c 8-15 python3 bench/trainer.py "${shape[@]}" --first-step \
      > "$OUT/cold_r1_noprologue.txt" 2>&1 &
    wait
    grep -h "first step" "$OUT/cold_r4.txt" "$OUT/cold_r1_noprologue.txt"
    timed=(--skip-overlap-off --warmup 3 --iters 10 --profile)
    TORCHINDUCTOR_CACHE_DIR=/tmp/ic_r4 TAIL=14 step train_r4 150 python3 bench/trainer.py \
      "${shape[@]}" "${timed[@]}" --rows-per-forward 4
    TORCHINDUCTOR_PROLOGUE_FUSION=0 TORCHINDUCTOR_CACHE_DIR=/tmp/ic_np TAIL=14 \
      step train_r1_noprologue 150 python3 bench/trainer.py "${shape[@]}" "${timed[@]}"
    ;;
  gen2)  # the fresh-prompt prefill (flash causal) with the compiled decode parts, 512 / 1024
    common=(--synthetic --backends static --prompts 2048 --prompt-lengths 200,1200
      --max-new-tokens 192 --compile)
    TAIL=6 step gen2_512 90 python3 bench/generate.py "${common[@]}" --batch-size 512
    TAIL=6 step gen2_1024 90 python3 bench/generate.py "${common[@]}" --batch-size 1024
    ;;
  gen)
    common=(--synthetic --backends static --prompts 2048 --prompt-lengths 200,1200
      --max-new-tokens 192 --batch-size 512)
    TAIL=8 step gen_sdpa 90 python3 bench/generate.py "${common[@]}"
    TAIL=8 step gen_sdpa_compiled 120 python3 bench/generate.py "${common[@]}" --compile
    TAIL=8 step gen_flex 120 python3 bench/generate.py "${common[@]}" --attention flex
    TAIL=8 step gen_flex_compiled 150 python3 bench/generate.py "${common[@]}" --attention flex \
      --compile
    ;;
  varlen)  # issue 17: the SmolLM2-shaped step at R = 4, the target's attention flex vs varlen
    export TORCHINDUCTOR_CACHE_DIR=/tmp/ic_layers
    shape=(--hidden 576 --intermediate 1536 --heads 9 --kv-heads 3 --head-dim 64
      --target-layers 30 --vocab 49152 --layers 3 --rows 8192 --skip-overlap-off --warmup 3
      --iters 10 --rows-per-forward 4)
    for attention in ${VARLEN_ORDER:-varlen flex}; do
      TAIL=14 step "attention_$attention" "${VARLEN_S:-280}" python3 bench/trainer.py \
        "${shape[@]}" --target-attention "$attention"
    done
    ;;
  muon)  # the SmolLM2-shaped step with each optimizer, profiled: where Muon's +11 ms go (the
    # quality runs of 2026-12-02 logged them in the *target* phase: 28 vs 19.5 ms)
    export TORCHINDUCTOR_CACHE_DIR=/tmp/ic_layers
    shape=(--hidden 576 --intermediate 1536 --heads 9 --kv-heads 3 --head-dim 64
      --target-layers 30 --vocab 49152 --layers 3 --rows 8192 --skip-overlap-off --warmup 3
      --iters 10 --profile --set target.compile_scope=layers)
    for optimizer in ${MUON_ORDER:-adamw muon}; do
      TAIL=40 step "optim_$optimizer" "${MUON_S:-280}" python3 bench/trainer.py "${shape[@]}" \
        --set optim.optimizer="$optimizer"
    done
    ;;
  dense)  # the hybrid's dense stand-in (64 x 5120, full attention everywhere), same rows
    TAIL=40 step trainer_27b_dense "${BENCH_S:-300}" python3 bench/trainer.py \
      --geometry 27b-dense --rows "${ROWS:-8192,16384}" --warmup 2 --iters 6 --skip-overlap-off
    ;;
  *)
    echo "unknown stage $stage (generate, smol, hybrid, dense, varlen, muon, cold, warm, stacked, gen)"
    exit 2
    ;;
  esac
done
