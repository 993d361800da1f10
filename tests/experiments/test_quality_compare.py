"""experiments/quality.py's reading stages (`compare`, `curves`, `pairs`) and
experiments/quality_compare.py under them: runs side by side, tau ratios with intervals paired
over whole sources, seeds pooled into one recipe."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
from helpers import quality_eval_report


def test_compare_sets_runs_beside_each_other_and_the_peer(
    quality: ModuleType, tmp_path: Path
) -> None:
    """`experiments/quality.py compare`: one row per run with the recipe keys that differ, the
    median step time and each kind's tau; the peer's row, and each run's tau over the peer's."""
    out = tmp_path / "q"
    recipes = {"base": "decay", "dpace": "dpace"}
    taus = {"base": (3.0, 2.0, 2.5), "dpace": (4.0, 2.2, 3.0)}
    for name, weighting in recipes.items():
        run = out / "runs" / name
        (run / "eval").mkdir(parents=True)
        for kind, tau in zip(("chat", "humaneval", "code"), taus[name], strict=True):
            report = quality_eval_report(tau, [0.5], speedup=tau * 0.7)
            (run / "eval" / f"{kind}.json").write_text(json.dumps(report))
        lines = [json.dumps({"step": s, "step_s": 0.03 + s * 1e-4}) for s in (20, 40, 60)]
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        loss = {"weighting": weighting, "anchors": 512}
        if name == "dpace":  # recorded by a version with a key the other run's had not yet
            loss["argmax_mix"] = 0.0
        required = {"target": {"path": "t"}, "data": {"datasets": ["d"]}}
        settings = {"run": {"output": str(run), **required, "loss": loss}}
        (out / "stages").mkdir(exist_ok=True)
        (out / "stages" / f"train-{name}.json").write_text(json.dumps({"settings": settings}))
    # a run stopped before its train marker: listed, and no reason to call every key different
    (out / "runs" / "started").mkdir()
    (out / "runs" / "started" / "metrics.jsonl").write_text(json.dumps({"step": 20}) + "\n")
    peer = out / "runs" / "peer-speculators"
    (peer / "eval").mkdir(parents=True)
    for kind, tau in zip(("chat", "humaneval", "code"), (5.0, 2.0, 3.0), strict=True):
        (peer / "eval" / f"{kind}.json").write_text(json.dumps(quality_eval_report(tau, [0.5])))
    (peer / "report.json").write_text(
        json.dumps({"steps": 60, "train_s": 4.5, "peer_version": "0.9.0"})
    )
    bench = tmp_path / "bench"
    _, config, _ = quality.parse(["compare", "--output", str(out), "--bench-dir", str(bench)])
    result = quality.run("compare", config, [])
    assert result["runs"] == ["base", "dpace", "started"] and result["peer"] is True
    (md,) = bench.glob("quality_*_compare.md")
    table = md.read_text()
    base = next(line for line in table.splitlines() if line.startswith("| base"))
    assert "loss.weighting=decay" in base and "anchors" not in base  # only what differs
    assert "argmax_mix" not in table  # a key added since: its default, the same in both
    assert "| 60 | 34.0 |" in base  # last step, median step time in ms
    assert "3.000 (2.10x)" in base and "| 0.60 | 1.00 | 0.83 |" in base  # tau / peer's
    started = next(line for line in table.splitlines() if line.startswith("| started"))
    assert "(no train record) | 20 |" in started
    peer_line = next(line for line in table.splitlines() if line.startswith("| peer"))
    assert "speculators 0.9.0" in peer_line and "| 75.0 |" in peer_line


def test_compare_shows_no_ratio_over_other_prompts(quality: ModuleType) -> None:
    """A peer evaluated on other prompts than the run (the held-out file's first 24 instead of
    the eval stage's spread over sources, as `quality_session.sh peer` did before s25) gets
    no ratio: one over two prompt sets would read as a measurement. Reports without
    per-prompt results (older ones) keep their plain ratio."""
    compare = sys.modules["quality_compare"]

    def ev(tau: float, ids: list[str] | None) -> dict:
        prompts = None if ids is None else [{"id": i, "acceptance_lengths": [2]} for i in ids]
        return {**quality_eval_report(tau, [0.5]), **({"per_prompt": prompts} if prompts else {})}

    def row(name: str, evals: dict) -> dict:
        return {
            "name": name,
            "recipe": {"recipe": "r"},
            "steps": 10,
            "step_ms": 1.0,
            "evals": evals,
        }

    mine = row(
        "mine",
        {"chat": ev(3.0, ["a", "b"]), "humaneval": ev(2.0, ["h1", "h2"]), "code": ev(2.0, None)},
    )
    peer = row(
        "peer",
        {"chat": ev(2.0, ["a", "c"]), "humaneval": ev(2.0, ["h1", "h2"]), "code": ev(1.0, ["x"])},
    )
    line = compare.compare_table([mine], peer).splitlines()[2]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[-3:] == ["— (other prompts)", "1.00 [1.00-1.00]", "2.00"]


def test_the_peers_step_time_is_its_logged_median(quality: ModuleType, tmp_path: Path) -> None:
    """The peer's ms/step in `compare` is the median of its logged intervals, as the runs'
    median step_s, not train_s / steps, which also counts its start-up and compilation; a
    resumed run's clock restarting is skipped; without a log, train_s / steps."""
    compare = sys.modules["quality_compare"]
    folder = tmp_path / "peer"
    folder.mkdir()
    (folder / "report.json").write_text(json.dumps({"steps": 80, "train_s": 80.0}))
    assert compare.peer_row(folder)["step_ms"] == 1000.0
    log = [(20, 70.0), (40, 72.0), (60, 74.2), (80, 5.0), (100, 7.0)]  # compiled, then resumed
    lines = [json.dumps({"step": s, "elapsed_s": e}) for s, e in log]
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert compare.peer_row(folder)["step_ms"] == pytest.approx(100.0)  # of 100, 110, 100 ms


def test_tau_ratio_interval_is_paired_over_prompts(quality: ModuleType) -> None:
    """The compare table's interval: resampling prompts, both runs' results on a prompt stay
    together. Equal runs give exactly 1; one prompt that decides the ratio widens it to cover
    both the ratio with and without that prompt."""
    compare = sys.modules["quality_compare"]

    def ev(*lengths: list[int]) -> dict:
        return {"per_prompt": [{"acceptance_lengths": x} for x in lengths]}

    same = ev([3, 3, 2], [1, 1], [5, 4])
    assert compare.tau_ratio_interval(same, same) == (1.0, 1.0)
    # prompt 3: 40 tokens in 10 steps vs 40 tokens in 4 steps; the others are equal
    mine = ev([2, 2, 2], [3, 3], [4] * 10)
    theirs = ev([2, 2, 2], [3, 3], [10] * 4)
    low, high = compare.tau_ratio_interval(mine, theirs)
    assert low < 46 / 15 / (46 / 9) < high <= 1.0  # the point ratio, inside; never above 1
    assert low < 0.7 and high == 1.0  # resamples without prompt 3 give exactly 1
    assert compare.tau_ratio_interval(mine, ev([1])) is None  # not the same prompts
    renamed = {"per_prompt": [dict(x, id=f"other{i}") for i, x in enumerate(theirs["per_prompt"])]}
    assert compare.tau_ratio_interval(mine, renamed) is None  # as many, but other prompts


def test_the_interval_draws_whole_sources(quality: ModuleType) -> None:
    """Prompts from one conversation move together: ten turns of one conversation that all
    favour `mine` count as one draw, so the interval widens against ten independent ones."""
    compare = sys.modules["quality_compare"]

    def ev(lengths: list[list[int]], sources: list[str] | None) -> dict:
        return {
            "per_prompt": [
                {
                    "id": str(i),
                    "acceptance_lengths": x,
                    **({"source": sources[i]} if sources else {}),
                }
                for i, x in enumerate(lengths)
            ]
        }

    mine = [[4, 4]] * 10 + [[2, 2]] * 10
    theirs = [[2, 2]] * 10 + [[2, 2]] * 10
    independent = compare.tau_ratio_interval(ev(mine, None), ev(theirs, None))
    one_conversation = ["a"] * 10 + [f"b{i}" for i in range(10)]
    clustered = compare.tau_ratio_interval(ev(mine, one_conversation), ev(theirs, None))
    assert independent is not None and clustered is not None
    assert clustered[1] - clustered[0] > independent[1] - independent[0]
    assert clustered[0] == 1.0  # a resample without conversation "a" is level
    by_id = dict(enumerate(one_conversation))  # the same sources, named by prompt id
    named = compare.tau_ratio_interval(
        ev(mine, None), ev(theirs, None), sources={str(i): s for i, s in by_id.items()}
    )
    assert named == clustered


def test_pooled_seeds_are_one_recipe_paired_over_sources(quality: ModuleType) -> None:
    """Two seeds of a recipe, pooled: each prompt keeps both runs' verify steps, tau is the
    recipe's over all of them (not the mean of the two taus), and the interval against
    another recipe resamples sources with every run's results on them. A list on either side
    of `paired_ratio_text` is pooled, before the loops too; runs of other prompts refuse."""
    compare = sys.modules["quality_compare"]

    def run(*lengths: list[int], loop: int = 0) -> dict:
        """Each output: its answer, then with `loop` a loop the drafter takes 15 at a time."""
        lengths = tuple(x + [15] * loop for x in lengths)
        prompts = [
            {
                "id": f"p{i}",
                "source": f"s{i // 2}",
                "acceptance_lengths": x,
                "output_ids": list(range(100, 101 + sum(x) - 15 * loop)) + [7] * (15 * loop),
            }
            for i, x in enumerate(lengths)
        ]
        steps = sum(len(x) for x in lengths)
        return {"tau": sum(map(sum, lengths)) / steps, "per_prompt": prompts}

    seed0 = run([4, 4], [2], [3, 3, 3], [1])
    seed1 = run([6], [2, 2], [3], [1, 1, 1, 1])
    both = compare.pooled([seed0, seed1])
    assert both["tau"] == pytest.approx((8 + 2 + 9 + 1 + 6 + 4 + 3 + 4) / 15)
    assert both["tau"] != pytest.approx((seed0["tau"] + seed1["tau"]) / 2)
    assert [p["acceptance_lengths"] for p in both["per_prompt"]] == [
        [4, 4, 6],
        [2, 2, 2],
        [3, 3, 3, 3],
        [1, 1, 1, 1, 1],
    ]
    assert [p["source"] for p in both["per_prompt"]] == ["s0", "s0", "s1", "s1"]
    assert compare.tau_ratio_interval(both, both) == (1.0, 1.0)
    # two sources: a resample holds s0 twice, s1 twice or one of each
    peer = run([2, 2, 2], [2], [2, 2], [2])
    low, high = compare.tau_ratio_interval(both, peer)
    on_s0, on_s1 = (8 + 2 + 6 + 4) / 6 / 2.0, (9 + 1 + 3 + 4) / 9 / 2.0
    assert (low, high) == pytest.approx((min(on_s0, on_s1), max(on_s0, on_s1)))
    line = compare.paired_ratio_text([seed0, seed1], peer)
    assert line.startswith(f"{both['tau']:.3f} / 2.000 = {both['tau'] / 2:.3f} [")
    assert "; before loops" in line
    assert compare.paired_ratio_text([seed0], peer) == compare.paired_ratio_text(seed0, peer)
    # the same outputs, each then in a loop of 135 tokens (LOOP_TAIL is 128): before the
    # loops, the pooled tau of the loop-free seeds again; over everything, the loops lift it
    looped = [
        run(*(p["acceptance_lengths"] for p in r["per_prompt"]), loop=9) for r in (seed0, seed1)
    ]
    whole, cut = compare.paired_ratio_text(looped, peer).split("; before loops ")
    assert whole.startswith(f"{compare.pooled(looped)['tau']:.3f} / 2.000 = ")
    assert cut.startswith(f"{both['tau']:.3f} / 2.000 = ")
    assert compare.pooled(looped)["tau"] > 5.0
    with pytest.raises(ValueError, match="other prompts"):
        compare.pooled([seed0, run([1], [1], [1])])
    renamed = {
        **seed1,
        "per_prompt": [dict(p, id=f"q{i}") for i, p in enumerate(seed1["per_prompt"])],
    }
    with pytest.raises(ValueError, match="other prompts"):
        compare.pooled([seed0, renamed])
    with pytest.raises(ValueError, match="per-prompt"):
        compare.pooled([seed0, {"tau": 2.0}])
    anonymous = [{k: v for k, v in p.items() if k != "id"} for p in seed1["per_prompt"]]
    with pytest.raises(ValueError, match="no id"):  # unmatched prompts are never pooled
        compare.pooled([{**seed0, "per_prompt": anonymous}, {**seed1, "per_prompt": anonymous}])
    unnamed = [{k: v for k, v in p.items() if k != "source"} for p in seed0["per_prompt"]]
    named_later = compare.pooled([{**seed0, "per_prompt": unnamed}, seed1])
    assert [p["source"] for p in named_later["per_prompt"]] == ["s0", "s0", "s1", "s1"]


def test_the_pairs_stage_pools_each_recipes_runs_over_a_baseline(
    quality: ModuleType, tmp_path: Path
) -> None:
    """`experiments/quality.py pairs --runs NAME=DIR[,DIR...] --peer DIR[,DIR...]`: each recipe's
    runs (run folders or eval folders) pooled per kind over the pooled baseline, with the
    paired interval; T = 1 where both ran it; a kind a run lacks pools the runs that have
    it; each run over each baseline run (the seeds' spread) where a side has several; a bad
    entry or an empty folder is a one-line error naming it."""

    def write(folder: Path, kind: str, lengths: list[list[int]]) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        prompts = [
            {"id": f"{kind}{i}", "source": f"s{i}", "acceptance_lengths": x,
             "output_ids": list(range(100, 101 + sum(x)))}
            for i, x in enumerate(lengths)
        ]  # fmt: skip
        steps = sum(map(len, lengths))
        report = {"tau": sum(map(sum, lengths)) / steps, "per_prompt": prompts}
        (folder / f"{kind}.json").write_text(json.dumps(report))

    a0, a1, p0, p1 = (tmp_path / n for n in ("a0", "a1", "p0", "p1"))
    write(a0 / "eval", "chat", [[4, 4], [2]])  # a run folder: its eval/ is read
    write(a0 / "eval", "chat_t1", [[2], [2]])
    write(a1 / "eval", "chat", [[6], [2, 2, 2]])
    write(a1 / "eval", "code", [[3, 3]])  # only a1 ran code
    write(p0, "chat", [[2, 2], [2]])  # eval folders given directly
    write(p0, "chat_t1", [[1], [1]])
    write(p1, "chat", [[2], [2, 2]])
    write(p1, "code", [[2, 2]])
    bench = tmp_path / "bench"
    argv = ["pairs", "--runs", f"a={a0},{a1}", "--peer", f"{p0},{p1}", "--bench-dir", str(bench)]
    _, config, _ = quality.parse(argv)
    result = quality.run("pairs", config, [])
    assert result["runs"] == ["peer", "a"] and result["baseline"] == "peer"
    md = next(bench.glob("quality_*_pairs.md")).read_text()
    # chat: a pools 8 + 2 + 6 + 6 = 22 in 7 steps (a0 alone: 3.333), the peer 12 in 6
    assert "| a | 3.143 (2) | 1.571 [" in md
    assert "| peer | 2.000 (2) | — |" in md
    # code: a1 alone (6 in 2 steps) over p1 alone (4 in 2)
    assert "3.000 (1) | 1.500 [1.50-1.50] |" in md
    t1 = md.split("At T = 1")[1]
    assert "| a | 2.000 (1) | 2.000 [2.00-2.00] |" in t1
    assert "Over the text before" in md and str(a0 / "eval") in md
    # run by run, where a side has several runs: chat 3.333 and 3.000 over 2.000 and 2.000;
    # code (one run a side) and T = 1 (one run a side) are left out
    by_run = md.split("Run by run")[1]
    assert "| run | chat: lowest-highest |" in by_run and "mined" not in by_run
    assert "| a | 1.500-1.667 (4) |" in by_run and "| peer |" not in by_run
    assert "Run by run at T = 1" not in md
    # a run of other prompts gets no ratio, pooled or run by run (as in `compare`)
    other = tmp_path / "other"
    write(other, "chat", [[3], [3]])
    report = json.loads((other / "chat.json").read_text())
    for prompt in report["per_prompt"]:
        prompt["id"] += "-elsewhere"
    (other / "chat.json").write_text(json.dumps(report))
    fresh = tmp_path / "bench-other"
    argv = ["pairs", "--runs", f"o={other}", "--peer", f"{p0},{p1}", "--bench-dir", str(fresh)]
    _, config, _ = quality.parse(argv)
    quality.run("pairs", config, [])
    md = next(fresh.glob("quality_*_pairs.md")).read_text()
    assert "| o | 3.000 (1) | — (other prompts) |" in md
    assert "| o | — |" in md.split("Run by run")[1]

    trained_only = tmp_path / "trained_only"
    trained_only.mkdir()
    (trained_only / "train.json").write_text("{}")  # no eval/ yet: no held-out report
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "chat.json").write_text("{")
    old = tmp_path / "old"
    old.mkdir()
    (old / "chat.json").write_text(json.dumps({"tau": 2.0}))  # written before per_prompt
    for bad, message in (
        (["--runs", "a"], "NAME=DIR"),
        (["--runs", f"a={trained_only}"], "holds no held-out eval report"),
        (["--runs", "a="], "names no folder"),
        (["--runs", f"a={a0},{a0 / 'eval'}"], "twice"),  # one run is not two seeds
        (["--runs", f"a={a0}", f"a={a1}"], "taken twice"),
        (["--runs", f"peer={a0}", "--peer", str(p0)], "taken twice"),
        (["--runs", f"a={tmp_path / 'broken'}"], "broken/chat.json: not an eval report"),
        (["--runs", f"a={a0},{old}", "--peer", str(p0)], r"pairs: a \(.*old\), chat: pooled"),
    ):
        _, config, _ = quality.parse(["pairs", *bad, "--bench-dir", str(bench)])
        with pytest.raises(ValueError, match=message):
            quality.run("pairs", config, [])
    # without --peer the first recipe is the baseline
    _, config, _ = quality.parse(
        ["pairs", "--runs", f"p={p0}", f"a={a0}", "--bench-dir", str(bench)]
    )
    assert quality.run("pairs", config, [])["baseline"] == "p"


def test_compare_repeats_its_table_over_the_text_before_the_loops(quality: ModuleType) -> None:
    """A target's repetition loop ("no no no ...") is accepted whole by any drafter: when an
    output falls into one, `compare` adds the table again over each prompt's verify steps
    that end before the loop, with the ratio to the peer on those steps."""
    compare = sys.modules["quality_compare"]

    def prompt(pid: str, answer: int, lengths: list[int]) -> dict:
        ids = list(range(100, 100 + answer)) + [7] * (1 + sum(lengths) - answer)
        return {"id": pid, "output_ids": ids, "acceptance_lengths": lengths}

    # 10 answer tokens, then a loop from index 10: steps 3 + 3 + 3 end at index 9, the rest loop
    looping = prompt("a", 10, [3, 3, 3] + [15] * 10)
    plain = {"id": "b", "output_ids": list(range(9)), "acceptance_lengths": [2, 2, 2, 2]}
    mine = {"tau": 9.0, "per_prompt": [looping, plain]}
    view = compare.before_loops(mine)
    assert view["loop_prompts"] == 1
    assert [p["acceptance_lengths"] for p in view["per_prompt"]] == [[3, 3, 3], [2, 2, 2, 2]]
    assert view["tau"] == pytest.approx(17 / 7)
    assert compare.before_loops({"tau": 2.0, "per_prompt": [{"acceptance_lengths": [2]}]}) is None
    theirs = {
        "tau": 8.0,
        "per_prompt": [prompt("a", 10, [1] * 9 + [15] * 10), dict(plain, acceptance_lengths=[8])],
    }
    assert compare.before_loops(theirs)["tau"] == pytest.approx(17 / 10)
    # the sessions' pairs files: the same two ratios on one line, each with its interval
    line = compare.paired_ratio_text(mine, theirs)
    assert (
        line.startswith("9.000 / 8.000 = 1.125 [")
        and "; before loops 2.429 / 1.700 = 1.429 [" in line
    )
    assert compare.paired_ratio_text(mine, theirs, before_loops_too=False) == line.split(";")[0]
    other = {"tau": 2.0, "per_prompt": [dict(plain, id="c")]}  # other prompts: no pairing
    unpaired = (
        "2.000 / 8.000 = 0.250 [no interval]; before loops 2.000 / 1.700 = 1.176 [no interval]"
    )
    assert compare.paired_ratio_text(other, theirs) == unpaired

    def row(name: str, evals: dict) -> dict:
        return {"name": name, "recipe": {"x": name}, "steps": 5, "step_ms": 1.0, "evals": evals}

    peer = row("peer", {"chat": theirs})
    peer["recipe"] = {"recipe": "theirs"}
    table = compare.render_compare([row("mine", {"chat": mine})], peer)
    first, second = table.split("Over the text before")
    assert "| 9.000 | — | — | 1.12" in first  # 9 / 8 over everything
    assert "| 2.429 | — | — | 1.43" in second  # (17/7) / (17/10) before the loops
    without = compare.render_compare([row("mine", {"chat": {"tau": 2.0}})], None)
    assert "Over the text before" not in without  # nothing loops: one table
    assert "T = 1" not in table + without  # no sampled evals: no T = 1 table
    sampled = row("mine", {"chat": {"tau": 2.0}})
    sampled["sampled"] = {"chat": {"tau": 1.5}}
    peer["sampled"] = {"chat": {"tau": 1.2}}
    table = compare.render_compare([sampled], peer)
    assert "At T = 1" in table and "| 1.500 | — | — | 1.25" in table.split("At T = 1")[1]


def test_compare_shows_where_the_acceptance_differs_by_position(quality: ModuleType) -> None:
    """The per-position table: each run's conditional acceptance c1..c8, and "mix", the tau
    of the run's c1 chained with the peer's later positions (1 + sum of running products)."""
    compare = sys.modules["quality_compare"]

    def row(name: str, cond: list[float] | None) -> dict:
        evals = {"chat": None if cond is None else {"tau": 2.0, "conditional_acceptance": cond}}
        return {"name": name, "recipe": {"recipe": name}, "steps": 5, "step_ms": 1.0,
                "evals": evals, "sampled": {}}  # fmt: skip

    mine, theirs = row("mine", [0.8, 0.5, 0.5]), row("peer", [0.6, 0.9, 0.5])
    table = compare.render_compare([mine], theirs)
    section = table.split("Conditional acceptance by draft position")[1]
    mix = 1 + 0.8 + 0.8 * 0.9 + 0.8 * 0.9 * 0.5  # mine's c1, the peer's c2 and c3
    assert f"| chat | mine | 0.800 | 0.500 | 0.500 |  |  |  |  |  | {mix:.3f} |" in section
    assert "| chat | peer | 0.600 | 0.900 | 0.500 |  |  |  |  |  | — |" in section
    # evaluated on other prompts than the peer: no mix (as no ratio in the tables above)
    mine["evals"]["chat"]["per_prompt"] = [{"id": "a", "acceptance_lengths": [2]}]
    theirs["evals"]["chat"]["per_prompt"] = [{"id": "b", "acceptance_lengths": [2]}]
    section = compare.render_compare([mine], theirs).split("by draft position")[1]
    assert "| chat | mine | 0.800 | 0.500 | 0.500 |  |  |  |  |  | — |" in section
    # a kind the peer was not evaluated on: the run's row, no mix
    mine["evals"]["humaneval"] = {"tau": 2.0, "conditional_acceptance": [0.5]}
    section = compare.render_compare([mine], theirs).split("by draft position")[1]
    assert "| code: HumanEval | mine | 0.500 |" in section
    assert compare._chained_tau([0.5, 0.5]) == pytest.approx(1.75)
    # no per-position data (older eval reports): no table
    assert "Conditional acceptance" not in compare.render_compare([row("old", None)], None)


def test_curves_set_runs_training_estimates_side_by_side_at_matched_steps(
    quality: ModuleType, tmp_path: Path
) -> None:
    """`experiments/quality.py curves`: tau_hat averaged per window of steps for runs finished or
    not (one stopped early shows — past its end), a run folder elsewhere by NAME=DIR (as
    in `pairs`), each run over the first; a named run without metrics, or the order before
    s41 (DIR=NAME), is a one-line error."""
    out = tmp_path / "q"
    for name, taus in {"base": [2.0, 4.0, 5.0, 7.0], "wide": [3.0, 5.0]}.items():
        (out / "runs" / name).mkdir(parents=True)
        lines = [json.dumps({"step": 10 * (i + 1), "tau_hat": t}) for i, t in enumerate(taus)]
        (out / "runs" / name / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    other = tmp_path / "raw" / "old-run"
    other.mkdir(parents=True)
    (other / "metrics.jsonl").write_text(json.dumps({"step": 20, "tau_hat": 6.0}) + "\n")
    bench = tmp_path / "bench"
    argv = ["curves", "--output", str(out), "--bench-dir", str(bench), "--window", "20"]
    _, config, _ = quality.parse([*argv, "--runs", "base", "wide", f"old={other}"])
    result = quality.run("curves", config, [])
    assert result["runs"] == ["base", "wide", "old"]
    (md,) = bench.glob("quality_*_curves.md")
    rows = [line for line in md.read_text().splitlines() if line.startswith("| ")]
    assert rows[0] == "| steps | base | wide | old | wide / base | old / base |"
    assert rows[1] == "| 20 | 3.000 | 4.000 | 6.000 | 1.333 | 2.000 |"
    assert rows[2] == "| 40 | 6.000 | — | — | — | — |"
    assert next(bench.glob("quality_*_curves.png")).read_bytes()[:4] == b"\x89PNG"
    _, config, _ = quality.parse(argv)
    assert quality.run("curves", config, [])["runs"] == ["base", "wide"]  # every run of OUT
    _, config, _ = quality.parse([*argv, "--runs", "gone"])
    with pytest.raises(FileNotFoundError, match="no metrics for run 'gone'"):
        quality.run("curves", config, [])
    _, config, _ = quality.parse([*argv, "--runs", f"old={tmp_path / 'raw' / 'gone'}"])
    with pytest.raises(FileNotFoundError, match="no metrics for run 'old="):
        quality.run("curves", config, [])
    _, config, _ = quality.parse([*argv, "--runs", "base", f"{other}=old"])  # the old order
    with pytest.raises(ValueError, match=re.escape(f"as in pairs: old={other} (DIR=NAME")):
        quality.run("curves", config, [])


def test_curves_read_peer_runs_by_their_eal_and_refuse_to_mix_measures(
    quality: ModuleType, tmp_path: Path
) -> None:
    """A peer run (experiments/peer_recipe.py) logs speculators' `eal`, not `tau_hat`: `curves`
    compares peer runs by it (s43 read `peer61` beside `peer6` so; before, every cell was —),
    refuses a flashdraft run beside a peer run (two measures on different anchors), and
    refuses metrics with neither, naming the file; a run lost before its first record shows
    dashes, and no run at all is a one-line error."""
    out = tmp_path / "q"
    runs = {
        "peer6": [{"eal": 2.0}, {"eal": 4.0}],
        "peer61": [{"eal": 3.0}, {"eal": 5.0}],
        "dpm6": [{"tau_hat": 3.0}],
        "bare": [{"loss": 1.0}],
        "lost": [],  # a run lost before its first record
    }
    for name, records in runs.items():
        (out / "runs" / name).mkdir(parents=True)
        lines = [json.dumps({"step": 10 * (i + 1), **r}) for i, r in enumerate(records)]
        (out / "runs" / name / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    bench = tmp_path / "bench"
    argv = ["curves", "--output", str(out), "--bench-dir", str(bench), "--window", "20"]
    _, config, _ = quality.parse([*argv, "--runs", "peer6", "peer61", "lost"])
    assert quality.run("curves", config, [])["runs"] == ["peer6", "peer61", "lost"]
    text = next(bench.glob("quality_*_curves.md")).read_text()
    assert text.startswith("# Training eal at matched steps") and "speculators' eal" in text
    assert "| 20 | 3.000 | 4.000 | — | 1.333 | — |" in text
    _, config, _ = quality.parse([*argv, "--runs", "dpm6", "peer6"])
    with pytest.raises(ValueError, match="dpm6: flashdraft's tau_hat, peer6: speculators' eal"):
        quality.run("curves", config, [])
    _, config, _ = quality.parse([*argv, "--runs", "peer6", "bare"])
    with pytest.raises(ValueError, match=r"bare/metrics.jsonl: run 'bare' logs no training"):
        quality.run("curves", config, [])
    _, config, _ = quality.parse(
        ["curves", "--output", str(tmp_path / "none"), "--bench-dir", str(bench)]
    )
    with pytest.raises(FileNotFoundError, match=r"no run with a metrics\.jsonl; pass --runs"):
        quality.run("curves", config, [])
