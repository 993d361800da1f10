#!/usr/bin/env bash
# Download the wheels that give a hybrid target (Qwen3.5 / Qwen3.6 / Qwen3-Next) its GPU
# kernels into .whl/fla (git-ignored), without dependencies: what the GPU image lacks.
#
# flashdraft's exact packed path for the Gated DeltaNet layers calls flash-linear-attention's
# varlen causal convolution and chunked gated delta rule (flashdraft/model/hybrid.py); they
# live in fla-core (pure Python + Triton; the image already has torch 2.11 and triton), which
# imports einops. fla-core >= 0.5 is needed for grouped value heads (48 value heads over 16
# key heads in the 27B); flash-linear-attention adds fla.layers / fla.models, which neither
# flashdraft nor transformers import, so it is left out (pass it as an extra argument if
# wanted). causal-conv1d has no wheel (a CUDA source build): flashdraft does not need it.
#
# Install on the device BEFORE anything imports transformers' qwen3_5 modeling file (it picks
# its kernels at import time), e.g.
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/fla/*.whl
#   PYTHONPATH=/tmp/site python bench/trainer.py --geometry 27b-hybrid --compare-paths
# Without them the bench still runs: the per-document fallback, said once at start-up.
#
#   bash dev/gpu/fla_wheels.sh                                    # into .whl/fla
#   bash dev/gpu/fla_wheels.sh flash-linear-attention==0.6.0      # extra wheels
set -euo pipefail
cd "$(dirname "$0")/../.."

WHEELS=(
  fla-core==0.6.0
  einops==0.8.2
  "$@"
)

dest=${WHEEL_DIR:-.whl/fla}
mkdir -p "$dest"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dest" "${WHEELS[@]}"

# One version of each package, or the install on the device refuses the whole set.
dupes=$(ls "$dest"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z_' 'a-z-' | sort | uniq -d)
if [ -n "$dupes" ]; then
  echo "more than one wheel of: $dupes (empty $dest and run again)" >&2
  exit 1
fi
du -ch "$dest"/*.whl | tail -1
