"""Train: the online training run, from packed rows to checkpoints and the final export.

Owns the run config (`config`) and its named presets (`presets`); what a run is before
anything loads (`plan`: placement, drafter geometry, the one builder of the initial drafter,
row stream, steps, resume point); packed rows (`packing`) and their blocks (`blocks`); the
loss (`loss`) and one drafter pass (`step`); the optimizer and its finite guard (`optim`) and
the LR schedule (`schedule`); where the target's features come from (`features`: the local
target, or a target rank through the split placement's `server`); the parallel layer
(`parallel`: torchrun, compile, DDP/FSDP2, placement, point-to-point channels); the memory
`preflight`; resumable `checkpoint`s; `metrics`; the in-training eval (`held_out`); the
rows of each step, the target running ahead over a group (`step_rows`); the `trainer` loop
that ties them together, and its checkpointed stop at SIGTERM (`stopping`); and `bench`, the
timing behind `flashdraft bench`. May import `model`, `data`, `eval` (in-training
evaluation), `export` and the base layer; never `commands`.
"""
