"""experiments/quality_positions.py through `experiments/quality.py pairs`: where a tau gap lies, per
draft position, before the outputs' repetition loops and inside them."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

LOOPING = list(range(100, 110)) + [7, 8] * 65  # 10 tokens, then a loop of period 2 from 10
STRAIGHT = list(range(100, 240))  # 140 tokens, no loop


def write(folder: Path, kind: str, ids: list[int], lengths: list[int]) -> None:
    """One eval report of one prompt, block size 8 (7 draft positions)."""
    assert sum(lengths) == len(ids) - 1  # the prefill emits the first token
    folder.mkdir(parents=True, exist_ok=True)
    prompt = {"id": "p0", "source": "s0", "acceptance_lengths": lengths, "output_ids": ids}
    report = {"tau": sum(lengths) / len(lengths), "per_prompt": [prompt]}
    report["settings"] = {"block_size": 8}
    (folder / f"{kind}.json").write_text(json.dumps(report))


def pairs_md(quality: ModuleType, bench: Path, *argv: str) -> str:
    """`experiments/quality.py pairs ARGV` into `bench`: its markdown."""
    _, config, _ = quality.parse(["pairs", *argv, "--bench-dir", str(bench)])
    quality.run("pairs", config, [])
    return next(bench.glob("quality_*_pairs.md")).read_text()


def test_pairs_splits_each_recipes_reach_per_draft_position_at_the_loops(
    quality: ModuleType, tmp_path: Path
) -> None:
    """`pairs` ends with, per kind where some output ends in a repetition loop, each
    recipe's steps split at its outputs' loops (the steps whose tokens all come before the
    loop, and the rest, the one across the loop's start included) and the share of them
    reaching each draft position, as many positions as the eval's block allows: where a gap
    lies. A kind without loops gets no table; a recipe without per-prompt outputs is named."""

    a, p = tmp_path / "a", tmp_path / "p"
    write(a, "chat", LOOPING, [3, 3, 3] + [8] * 16 + [2])  # 9 tokens before the loop
    write(p, "chat", LOOPING, [5, 6] + [8] * 16)  # the 6 runs from index 6 into the loop
    write(a, "code", STRAIGHT, [3] * 46 + [1])
    write(p, "code", STRAIGHT, [3] * 46 + [1])
    md = pairs_md(quality, tmp_path / "bench", "--runs", f"a={a}", "--peer", str(p))
    tables = md.split("per draft position")
    assert len(tables) == 2 and "chat, T = 0" in tables[0].splitlines()[-1]  # code: no loop
    assert "| run | text | steps | tau | 1 | 2 | 3 | 4 | 5 | 6 | 7 |\n" in tables[1]
    rows = {
        tuple(c.strip() for c in line.split("|")[1:3]): line
        for line in tables[1].splitlines()
        if line.startswith("| a") or line.startswith("| peer")
    }
    assert rows["a", "before the loop"].endswith("| 3 | 3.000 | 1.00 | 1.00 |" + " 0.00 |" * 5)
    # 16 steps of 8 reach every position, the last step's 2 only the first
    assert rows["a", "from the loop on"].endswith("| 17 | 7.647 | 1.00 |" + " 0.94 |" * 6)
    assert rows["peer", "before the loop"].endswith("| 1 | 5.000 |" + " 1.00 |" * 4 + " 0.00 |" * 3)
    assert rows["peer", "from the loop on"].endswith(
        "| 17 | 7.882 |" + " 1.00 |" * 5 + " 0.94 |" * 2
    )
    # a recipe whose reports predate the kept output ids is named, not dropped silently
    old = tmp_path / "old"
    write(old, "chat", LOOPING, [3, 3, 3] + [8] * 16 + [2])
    report = json.loads((old / "chat.json").read_text())
    del report["per_prompt"][0]["output_ids"]
    (old / "chat.json").write_text(json.dumps(report))
    md = pairs_md(quality, tmp_path / "b2", "--runs", f"a={a}", f"old={old}", "--peer", str(p))
    assert "(left out, no per-prompt outputs: old)" in md.split("per draft position")[1]


def test_pairs_counts_whole_blocks_inside_established_loops(
    quality: ModuleType, tmp_path: Path
) -> None:
    """`pairs`' copy table: per kind with loops, each recipe's verify steps that start in
    the third period of an output's loop or later (the last step of the output left out, as
    max_new_tokens cuts it), the share accepting the whole block, by the loop's period, and
    the loop missed most; a kind without loops gets no table."""

    a, p = tmp_path / "a", tmp_path / "p"
    # steps start at 1, 4, 7, 10, 18, ..., 122, 130, 135: those from 14 (the third period)
    # are the fourteen 8s from 18 and the 5 at 130 (a miss); the last step is left out
    write(a, "chat", LOOPING, [3, 3, 3] + [8] * 15 + [5, 5])
    write(p, "chat", LOOPING, [5, 6] + [8] * 16)  # from 20: fourteen 8s, then the last step
    write(a, "code", STRAIGHT, [3] * 46 + [1])
    write(p, "code", STRAIGHT, [3] * 46 + [1])
    md = pairs_md(quality, tmp_path / "bench", "--runs", f"a={a}", "--peer", str(p))
    tables = md.split("inside established loops")
    assert len(tables) == 2 and tables[0].splitlines()[-1].startswith("chat, T = 0")
    assert "| run | steps | whole block | period 1-4 | period 5-12 | period 13-32 |" in tables[1]
    assert "| a | 15 | 0.93 | 14/15 | — | — | p0 (2): 14/15 |" in tables[1]
    assert "| peer | 14 | 1.00 | 14/14 | — | — | — |" in tables[1]
