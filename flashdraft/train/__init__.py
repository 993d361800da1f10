"""Train: the online training run, from packed rows to checkpoints and the final export.

Owns the run config (`config`), packing and blocks, the loss and one drafter step, the
parallel layer (torchrun, compile, DDP/FSDP2, placement), memory preflight, resumable
checkpoints, metrics, and the trainer that ties them together. May import `model`, `data`,
`eval` (in-training evaluation), `export` and the base layer; never `commands`.
"""
