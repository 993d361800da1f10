"""Golden values: a fixed-seed 20-step run on the tiny Qwen3 target, pinned bit for bit.

Every other training test compares one run with another; this one compares with numbers
recorded before the package was restructured (issue 14), so a refactor that changes what is
computed (an op order, a mask, a normaliser) fails here even if it changes every run alike.
The values are CPU float32 with one intra-op thread (tests/conftest.py). If a change is
*meant* to alter the numbers, re-record them with `python tests/test_golden.py RUN_DIR`
and say why in the commit.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

from helpers import read_metrics, train_settings

from flashdraft import cli

STEPS = 20

# (loss, tau_hat, grad_norm) per step, as logged in metrics.jsonl (5, 4 and 4 decimals).
GOLDEN: list[tuple[float, float, float]] = [
    (14.2852, 1.0, 2.0328),
    (13.98299, 1.0, 2.393),
    (13.33749, 1.0, 2.5665),
    (11.96497, 1.0, 1.5744),
    (11.94891, 1.1042, 1.0372),
    (12.0863, 1.0417, 1.2393),
    (12.17583, 1.0417, 0.8375),
    (11.88842, 1.0417, 0.7504),
    (11.87251, 1.0833, 0.7437),
    (12.11398, 1.1667, 0.9238),
    (12.27535, 1.0625, 0.7926),
    (11.95003, 1.0625, 0.6556),
    (11.63892, 1.125, 0.7217),
    (11.80488, 1.0417, 0.5441),
    (12.33574, 1.0625, 0.5695),
    (11.76478, 1.0833, 0.6492),
    (12.26791, 1.0208, 0.6618),
    (12.0979, 1.0417, 0.5511),
    (11.68959, 1.0625, 0.5734),
    (11.60831, 1.0833, 0.7163),
]
# sha256 over the fp32 drafter weights of the last checkpoint, names sorted.
GOLDEN_WEIGHTS = "b2da2dd23f402c314c1ae6e27573f0ccb83ee2da520b8ca4bd6151a9472eb557"


def _settings(run: Path, target: Path, data: Path) -> list[str]:
    return train_settings(
        run,
        target,
        data,
        **{
            "optim.max_steps": STEPS,
            "log.every": 1,
            "checkpoint.every": STEPS,
            "log.tensorboard": "false",
            "seed": 7,
            # Data labels: the tiny random target's own argmax is noise that nothing learns
            # in 20 steps, and pinned values that never move would pin little.
            "loss.labels": '"data"',
            "optim.grad_accum": 2,
        },
    )


def weights_digest(run: Path) -> str:
    from safetensors.torch import load_file

    (checkpoint,) = sorted((run / "checkpoints").iterdir())[-1:]
    weights = load_file(checkpoint / "drafter.safetensors")
    digest = hashlib.sha256()
    for name in sorted(weights):
        digest.update(name.encode())
        digest.update(weights[name].float().numpy().tobytes())
    return digest.hexdigest()


def observed(run: Path) -> tuple[list[tuple[float, float, float]], str]:
    records = read_metrics(run)
    return [(r["loss"], r["tau_hat"], r["grad_norm"]) for r in records], weights_digest(run)


def test_a_fixed_seed_run_reproduces_the_pinned_losses_bit_for_bit(
    tmp_path, tiny_qwen3_dir, qwen_data
) -> None:
    run = tmp_path / "run"
    assert cli.main(["train", *_settings(run, tiny_qwen3_dir, qwen_data)]) == 0
    values, digest = observed(run)
    assert [r["step"] for r in read_metrics(run)] == list(range(1, STEPS + 1))
    assert values == GOLDEN
    assert digest == GOLDEN_WEIGHTS


if __name__ == "__main__":  # print the values of a finished run, to paste above
    values, digest = observed(Path(sys.argv[1]))
    print(json.dumps(values))
    print(digest)
