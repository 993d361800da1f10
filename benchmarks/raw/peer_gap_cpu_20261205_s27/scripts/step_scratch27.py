"""The scratch numbers of peer_gap_cpu_20261205_s27.md section 1 that the tests only bound:
flashdraft's step with the peer's settings against speculators' on the tests' tiny target and
row (tests/test_peer_step.py's `Pair`), in fp32 on the CPU.

Prints: the loss on both sides and the worst gradient's relative difference; then 4 optimizer
steps where each side steps on its own gradients (how far the weights drift apart, as a share
of their movement); then 4 steps where flashdraft's optimizer gets speculators' gradients and
the weights are put back in line after each (how far one update differs).

    .venv/bin/python benchmarks/raw/peer_gap_cpu_20261205_s27/scripts/step_scratch27.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "tests"))
from test_peer_step import DOCS, STEPS, Pair, relative  # noqa: E402

from flashdraft.train.optim import build_optimizer  # noqa: E402

LRS = (2e-4, 1e-3, 8e-4, 5e-4)


def main() -> None:
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        pair = Pair(Path(tmp), DOCS)
        their_loss, theirs = pair.their_step()
        our_loss, ours = pair.our_step()
        print(f"loss: speculators {their_loss!r} flashdraft {our_loss!r}")
        print(f"worst gradient relative difference: {relative(ours, theirs):.2e}")
        for shared in (False, True):
            pair.sync()
            start = {k: v.clone() for k, v in pair.ours.state_dict().items()}
            mine_opt = build_optimizer(pair.ours, pair.run.optim, torch.device("cpu"))
            their_opt, _ = pair.peer.build_optimizers(pair.theirs, pair.flat, STEPS)
            print("same gradients, weights re-synced" if shared else "each its own gradients")
            for step, lr in enumerate(LRS):
                pair.their_step()
                pair.our_step()
                for model in (pair.theirs, pair.ours):
                    torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0)
                if shared:
                    named = dict(pair.ours.named_parameters())
                    for k, p in pair.theirs.named_parameters():
                        if k in named:
                            named[k].grad = p.grad.clone()
                for optimizer in [*their_opt, *mine_opt]:
                    for group in optimizer.param_groups:
                        group["lr"] = lr
                    optimizer.step()
                mine = pair.ours.state_dict()
                peer = {k: v for k, v in pair.theirs.state_dict().items() if k in mine}
                moved = {k: peer[k] - start[k] for k in mine}
                ahead = {k: mine[k] - start[k] for k in mine}
                print(f"  step {step}: worst |ours - theirs| / movement {relative(ahead, moved):.2e}")
                if shared:  # only this step's difference shows in the next
                    pair.ours.load_state_dict(peer)


if __name__ == "__main__":
    main()
