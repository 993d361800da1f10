"""The README's and the guides' command lines are tests: every `flashdraft ...` line that
README.md or a guide in docs/ shows runs, in pipeline order, on a tiny Qwen3 target, and its
outputs are checked, so the documentation cannot drift from the code. Their relative links
resolve, and docs/architecture.md names every module.

What counts as a command line: a line of a fenced code block, or an inline code span, that
starts with `flashdraft ` (backslash continuations joined, `# comments` dropped), and the
`torchrun ... -m flashdraft.cli ...` lines of code blocks. An inline span that is only
`flashdraft NAME` names a subcommand: it must exist, nothing runs. Lines of other programs
(`make demo` and `make test`, which build a virtual environment and run the whole demo or
suite: tests/test_demo.py and the suite itself cover them; pip, the serving engines,
tensorboard, the peer benchmark scripts) are not flashdraft's command lines and are left out.

How they run, in the order generate -> prepare -> audit -> bench -> train -> export -> eval
(document order within a stage, a `--resume` after the run it resumes), each through
`flashdraft.cli.main` in one working directory:

* placeholders are replaced by `SUBSTITUTIONS` (model names and paths -> the tiny target,
  `RUN` -> the example config's run directory, `s3://bucket/` -> a local folder);
* the inputs a user brings are made first: real chitchat conversations in `data/chats/` and
  `bucket/more/`, held-out prompts in `data/held_out.jsonl`, and `configs/qwen3-8b.toml`
  (the repository's, with the same substitutions);
* `EXTRA` flags are appended per subcommand to keep it small (a later flag or `--set` wins):
  16 new tokens per answer, one prepare worker, a 2-step run on 256-token rows with 4 anchors
  each (the loss over the 152k-token vocabulary is most of a step), 8-token evals,
  bench on the larger of the two prepared datasets;
  generate also gets `--thinking off --temperature 2 --keep-truncated`: the tiny random
  target copies its last input token (a newline) at low temperature and never closes a think
  block, while `generate` keeps only answers with text, closed, and ended (or `--keep-truncated`);
* `torchrun` lines need several processes: their arguments are parsed into the run config
  and its placement is checked for the world size they ask for (nodes x processes), without
  running; a `srun ... torchrun ...` line is its torchrun part (tests/train/test_multinode.py
  runs real multi-node launches).

The test ends by checking that it ran every command line it found: a line added to the
README or a guide that no stage knows makes it fail.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashdraft import cli
from flashdraft import config as cfg
from flashdraft.assets import chitchat_conversations
from flashdraft.commands import train as train_command
from flashdraft.train import parallel
from flashdraft.train.parallel import DistInfo, assign_placement

REPO = Path(__file__).resolve().parents[1]
# The user-facing documents, README first: their command lines run in this order within a stage.
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
RUN = "runs/qwen3-8b-dflash"  # the `output` of configs/qwen3-8b.toml

STAGES = ("generate", "prepare", "audit", "bench", "train", "export", "eval")
TINY_RUN = {
    "target.dtype": '"auto"',  # fp32 on the CPU
    "data.row_tokens": 256,
    "loss.anchors": 4,
    "optim.max_steps": 2,
    "optim.warmup_steps": 1,
    "checkpoint.every": 1,
    "log.every": 1,
    "log.progress": "false",
    "eval.max_new_tokens": 8,
}
SETS = [a for key, value in TINY_RUN.items() for a in ("--set", f"{key}={value}")]
EXTRA: dict[str, list[str]] = {
    "generate": [
        *("--max-new-tokens", "16", "--thinking", "off", "--temperature", "2"),
        *("--keep-truncated", "--no-progress"),
    ],
    "prepare": ["--workers", "1", "--no-progress"],
    "audit": [],
    # bench times 4 rows: the larger dataset (the 3 rows of data/qwen3-8b are too few)
    "bench": [*SETS, "--set", 'data.datasets=["data/qwen3"]', "--warmup", "0", "--iters", "1"],
    "train": SETS,
    "export": [],
    "eval": ["--max-new-tokens", "8", "--limit", "2"],
}


def substitutions(target: Path) -> list[tuple[str, str]]:
    """(regex, replacement) applied to every command line and to the example config."""
    return [
        (r"/models/Qwen3-8B\b", str(target)),
        (r"\bQwen/Qwen3-8B\b", str(target)),
        (r"\bs3://bucket/", "bucket/"),
        (r"\bRUN\b", RUN),
    ]


def substitute(text: str, table: list[tuple[str, str]]) -> str:
    for pattern, replacement in table:
        text = re.sub(pattern, replacement, text)
    return text


# ---- extraction ----------------------------------------------------------------------------


def extract(markdown: str) -> tuple[list[str], list[str]]:
    """(command lines, bare subcommand names) in document order."""
    commands: list[str] = []
    prose: list[str] = []
    block: list[str] | None = None
    for line in markdown.splitlines():
        if line.strip().startswith("```"):
            if block is not None:
                commands += _block_commands(block)
            block = None if block is not None else []
            continue
        (block if block is not None else prose).append(line)
    bare: list[str] = []
    for span in re.findall(r"`([^`]+)`", "\n".join(prose)):
        text = " ".join(span.split())
        if not text.startswith("flashdraft "):
            continue
        if len(text.split()) == 2:
            bare.append(text.split()[1])
        else:
            commands.append(text)
    return commands, bare


def _block_commands(lines: list[str]) -> list[str]:
    joined: list[str] = []
    for line in lines:
        if joined and joined[-1].endswith("\\"):
            joined[-1] = joined[-1][:-1] + " " + line.strip()
        else:
            joined.append(line.strip())
    found = []
    for line in joined:
        if line.startswith("srun ") and " torchrun " in line:  # a SLURM wrapper: its torchrun
            line = line[line.index(" torchrun ") + 1 :]
        if line.split(" ", 1)[0] in ("flashdraft", "torchrun"):
            found.append(shlex.join(shlex.split(line, comments=True)))
    return found


def test_the_file_tree_names_every_module() -> None:
    """docs/architecture.md's file tree has a line for every module of the package (each
    package's `__init__` and the one-line `commands/` excepted) and every script of bench/
    and experiments/, so a new module cannot go unlisted."""
    tree = (REPO / "docs" / "architecture.md").read_text()
    listed = {
        line.split()[0] for line in tree.splitlines() if line.startswith("  ") and line.split()
    }
    package = REPO / "flashdraft"
    modules = {
        p.name
        for p in package.rglob("*.py")
        if p.name != "__init__.py" and p.parent.name != "commands"
    }
    scripts = {p.name for folder in ("bench", "experiments") for p in (REPO / folder).glob("*.py")}
    missing = (modules | scripts) - listed
    assert not missing, f"missing from docs/architecture.md's file tree: {sorted(missing)}"


def test_every_relative_link_of_the_documents_resolves() -> None:
    """A link from README.md, docs/, benchmarks/RESULTS.md or the shipped drafter's card to a
    file of the repository points at a file that exists (records leave the tree; their links
    must not dangle)."""
    pages = [
        *DOCUMENTS,
        REPO / "benchmarks" / "RESULTS.md",
        *(REPO / "flashdraft" / "artifacts").glob("*/README.md"),
    ]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor of the page itself
            if not (page.parent / target.split("#")[0]).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_the_extraction_finds_commands_in_blocks_and_inline_spans() -> None:
    text = (
        "Run `flashdraft audit d --preview\n  3` or `flashdraft demo`; `flashdraft.data` is a module.\n"
        "```bash\nflashdraft train --config c.toml \\\n    --set a=1   # a comment\nmake demo\n"
        "torchrun --nproc-per-node 2 -m flashdraft.cli train --config c.toml\n"
        'srun --ntasks-per-node 1 torchrun --nnodes 2 --nproc-per-node 4 \\\n  --rdzv-endpoint "$h:1" -m flashdraft.cli train\n```\n'
    )
    commands, bare = extract(text)
    assert commands == [
        "flashdraft train --config c.toml --set a=1",
        "torchrun --nproc-per-node 2 -m flashdraft.cli train --config c.toml",
        "torchrun --nnodes 2 --nproc-per-node 4 --rdzv-endpoint '$h:1' -m flashdraft.cli train",
        "flashdraft audit d --preview 3",
    ]
    assert bare == ["demo"]


# ---- the pipeline ---------------------------------------------------------------------------


def _write_jsonl(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _user_inputs(root: Path, target: Path, table: list[tuple[str, str]]) -> None:
    """What a user brings before the first command: conversations, held-out prompts, the
    run config (the repository's example, paths substituted)."""
    # Real chats, cut to their first exchange: short prompts keep generation fast.
    chats = [{**c, "messages": c["messages"][:2]} for c in chitchat_conversations(24, seed=3)]
    _write_jsonl(root / "data" / "chats" / "part-a.jsonl", chats[:16])
    _write_jsonl(root / "bucket" / "more" / "b.jsonl", chats[16:])
    questions = ("What is the capital of France?", "Name three colours.")
    held_out = [{"messages": [{"role": "user", "content": q}]} for q in questions]
    _write_jsonl(root / "data" / "held_out.jsonl", held_out)
    config = (REPO / "configs" / "qwen3-8b.toml").read_text()
    (root / "configs").mkdir()
    (root / "configs" / "qwen3-8b.toml").write_text(substitute(config, table))


def _stage(words: list[str]) -> str:
    if words[0] == "torchrun":
        return "train"
    assert words[1] in STAGES, f"a documented command with no stage in tests/test_docs.py: {words}"
    return words[1]


def _check_torchrun(words: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Parse a torchrun line's arguments into the run config and check its placement for
    the world size it asks for (one process cannot run it: no process group is made)."""
    monkeypatch.setattr(parallel.dist, "new_group", lambda *ranks, **backend: None)
    world = int(words[words.index("--nproc-per-node") + 1])
    if "--nnodes" in words:  # the world of a multi-node launch (node count x processes)
        world *= int(words[words.index("--nnodes") + 1])
    rest = words[words.index("flashdraft.cli") + 1 :]
    assert rest[0] == "train", words
    parser = argparse.ArgumentParser()
    train_command.add_arguments(parser)
    options = cfg.from_args(train_command.TrainOptions, parser.parse_args([*rest[1:], *SETS]))
    config = options.run.load()
    for rank in range(world):
        info = DistInfo(rank=rank, world=world, local_rank=rank, device=torch.device("cpu"))
        assign_placement(info, config.parallel.placement, config.parallel.target_ranks)


def _option(words: list[str], flag: str) -> str:
    return words[words.index(flag) + 1]


def _check_outputs(words: list[str], root: Path, out: str) -> None:
    """What each command must have written."""
    stage = words[1]
    if stage == "generate":
        records = [json.loads(x) for x in (root / _option(words, "--output")).open()]
        assert records and all(r["id"] and "completion" in r for r in records)
    elif stage == "prepare":
        manifest = json.loads((root / _option(words, "--output") / "manifest.json").read_text())
        assert manifest["status"] == "complete" and manifest["counts"]["samples"] > 0
    elif stage == "bench":
        assert json.loads(out.strip().splitlines()[-1])["bench"] == "run"
    elif stage == "train" and "--plan" in words:  # a table of layouts; nothing trained
        assert "--set" in out or "fits" in out, out[-500:]
    elif stage == "train":
        run = root / RUN if "--preset" not in words else root / "runs" / "from-preset"
        assert (run / "export" / "model.safetensors").exists()
        assert json.loads((run / "run_config.json").read_text())["target"]["path"]
        assert not (run / "config.json").exists()  # a name serving engines read
    elif stage == "export":
        data = json.loads((root / _option(words, "--output") / "config.json").read_text())
        spec = "--format" in words and _option(words, "--format") == "speculators"
        assert ("speculators_model_type" in data) == spec
    elif stage == "eval":
        report = json.loads((root / _option(words, "--output")).read_text())
        assert report["lossless"] is True and 1.0 <= report["tau"] <= 16
        assert (root / _option(words, "--output")).with_suffix(".png").exists()


def test_every_readme_command_line_runs_on_a_tiny_target(
    tmp_path, tiny_qwen3_dir, monkeypatch, capsys
) -> None:
    commands, bare = [], []
    for page in DOCUMENTS:
        page_commands, page_bare = extract(page.read_text())
        commands += page_commands
        bare += page_bare
    assert set(bare) <= set(cli.COMMANDS), sorted(set(bare) - set(cli.COMMANDS))
    table = substitutions(tiny_qwen3_dir)
    # document order, each line once (quoting normalised: the same words are the same line)
    lines = list(dict.fromkeys(shlex.join(shlex.split(substitute(c, table))) for c in commands))
    assert not [c for c in lines if "/models/" in c or "s3://" in c]  # every placeholder set
    ordered = sorted(
        (shlex.split(c) for c in lines),
        key=lambda w: (STAGES.index(_stage(w)), "--resume" in w),
    )
    _user_inputs(tmp_path, tiny_qwen3_dir, table)
    monkeypatch.chdir(tmp_path)
    ran = []
    for words in ordered:
        capsys.readouterr()
        if words[0] == "torchrun":
            _check_torchrun(words, monkeypatch)
        else:
            code = cli.main([*words[1:], *EXTRA[words[1]]])
            captured = capsys.readouterr()
            assert code == 0, (shlex.join(words), captured.err[-2000:])
            _check_outputs(words, tmp_path, captured.out)
        ran.append(shlex.join(words))
    assert sorted(ran) == sorted(lines)  # every line the documents show, none skipped
    assert {w[1] for w in map(shlex.split, ran) if w[0] == "flashdraft"} == set(STAGES)


@pytest.mark.usefixtures("smollm2_dir")
def test_the_python_one_liners_of_the_documents_run() -> None:
    """Every `.venv/bin/python -c "..."` line of the documents (how to get the converted
    SmolLM2 without the demo, ...) runs with this interpreter and exits 0; what it prints that
    looks like a path exists (the conversion itself is cached by the fixture)."""
    lines = [
        line.strip()
        for page in DOCUMENTS
        for line in page.read_text().splitlines()
        if line.strip().startswith(".venv/bin/python -c ")
    ]
    assert lines, "the README shows how to get the converted SmolLM2 without the demo"
    for line in lines:
        words = shlex.split(line)
        done = subprocess.run(
            [sys.executable, *words[1:]], capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, (line, done.stderr[-2000:])
        printed = done.stdout.strip().splitlines()[-1]
        if printed.startswith("/"):
            assert Path(printed).exists(), printed
