#!/usr/bin/env bash
# Download the wheels bench/peers.py needs on the GPU image into .whl/ (git-ignored), for
# Python 3.12 on x86-64 Linux, without dependencies: exactly the packages the image lacks.
#
# The image already has torch 2.11, transformers 5.17, triton, numpy, pandas, pyarrow, fsspec,
# huggingface-hub, aiohttp, httpx, anyio, xxhash, pyyaml, rich, ... (see the device notes).
# Missing, and imported when the peers' DFlash trainers are imported:
#   speculators 0.9.0  -> hs-connectors, openai (-> httpx2, httpcore2, truststore, jiter,
#                         sniffio, pydantic), pydantic (-> pydantic-core, annotated-types,
#                         typing-inspection, typing-extensions >= 4.16), datasets (-> dill,
#                         multiprocess)
#   specforge 0.2.0    -> nothing beyond the image for its DFlash model and optimizer
#   experiments/peer_recipe.py (speculators' own settings schema and verifier-weight loader)
#                      -> pydantic-settings (-> python-dotenv), loguru
# Versions are the ones pip resolves for speculators 0.9.0 today, pinned so the bundle is
# reproducible. Their declared pins that we do NOT honour: specforge wants torch==2.11.0 (the
# image has it), transformers==5.8.1 (the image has 5.17), sglang==0.5.14, wandb, yunchang,
# tensorboard, openai-harmony (none imported by its DFlash path); speculators wants
# torchvision/torchaudio (not imported on either path).
#
#   bash dev/gpu/peers_wheels.sh                  # then carry .whl to the device (see README)
#   bash dev/gpu/peers_wheels.sh pyarrow==26.0.1  # extra wheels, if the image's turn out too old
set -euo pipefail
cd "$(dirname "$0")/../.."

WHEELS=(
  speculators==0.9.0
  specforge==0.2.0
  hs-connectors==0.9.0
  openai==3.57.0
  httpx2==2.16.2
  httpcore2==2.16.2
  truststore==0.10.5
  jiter==0.19.0
  sniffio==1.3.1
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  datasets==5.1.0
  dill==0.4.1
  multiprocess==0.70.19
  pydantic-settings==2.16.3
  python-dotenv==1.2.4
  loguru==0.7.3
  "$@"
)

dest=${WHEEL_DIR:-.whl}
mkdir -p "$dest"
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux1_x86_64 -d "$dest" "${WHEELS[@]}"

# One version of each package, or the install on the device refuses the whole set.
dupes=$(ls "$dest"/*.whl | xargs -n1 basename | cut -d- -f1 | tr 'A-Z_' 'a-z-' | sort | uniq -d)
if [ -n "$dupes" ]; then
  echo "more than one wheel of: $dupes (empty .whl/ and run again)" >&2
  exit 1
fi
du -ch "$dest"/*.whl | tail -1
