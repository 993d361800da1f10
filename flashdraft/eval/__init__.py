"""Eval: real acceptance of a drafter against the live target. Owns the draft-and-verify
decode loop (`speculative`, on HF caches; `fast`, the same loop on static caches as one
CUDA graph per step), the evaluation prompts (`prompts`), the measurement and the
options of `flashdraft eval` (`evaluate`), and the report built from it: statistics, the
lossless accounting, timing, plot and summary (`report`). May import `model`, `data` (to read
and render prompts), `export` and the base layer; never `train` or `commands` (the command
loads drafters from training checkpoints through `flashdraft.train.checkpoint`).
"""
