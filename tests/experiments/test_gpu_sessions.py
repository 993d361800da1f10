"""The device session scripts (dev/gpu/quality_session.sh and the other *_session.sh): their
stages parse, refuse what they cannot do in one line before any work, carry a run's checkpoint
over calls, and run peers and ablations side by side in their own folders. Run on the CPU with
stand-ins for the GPU work, so a broken stage fails here, not on the device machine."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_device_session_scripts_parse_and_refuse_an_unknown_stage(tmp_path: Path) -> None:
    """A shell syntax error in a session script costs a device call: `bash -n` here, and an
    unknown stage ends with exit 2 and the list of stages, before any work."""
    scripts = sorted((ROOT / "dev" / "gpu").glob("*.sh"))
    assert {"quality_session.sh", "checks_session.sh"} <= {p.name for p in scripts}
    for script in scripts:
        subprocess.run(["bash", "-n", str(script)], check=True, timeout=60)
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "HOME": str(tmp_path)}
    for script, expect in (("quality_session.sh", "multi"), ("checks_session.sh", "muon")):
        done = subprocess.run(
            ["bash", str(ROOT / "dev" / "gpu" / script), "nope"],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 2, (script, done.stdout, done.stderr)
        assert "unknown stage nope" in done.stdout and expect in done.stdout


def test_a_stage_on_a_fresh_machine_says_so_in_one_line_before_any_work(tmp_path: Path) -> None:
    """A device call that finds a fresh machine (the one that ran `one` has gone) ends at once
    with exit 3 and what to run, for every stage that needs `one`'s wheels; with them, the
    guard lets the stage go on (here to `multi`'s own complaint that ABLATIONS is unset)."""
    site = tmp_path / "site"
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "HOME": str(tmp_path),
           "SITE": str(site)}  # fmt: skip
    script = str(ROOT / "dev" / "gpu" / "quality_session.sh")
    for stage in ("two", "more", "multi", "ablate", "peer", "peereval"):
        done = subprocess.run(
            ["bash", script, stage], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=60,
        )  # fmt: skip
        assert done.returncode == 3, (stage, done.stdout, done.stderr)
        lines = done.stdout.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("== fresh machine:"), (stage, lines)
        assert "run `one`" in lines[0]
    site.mkdir()
    done = subprocess.run(
        ["bash", script, "multi"], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode != 3 and "fresh machine" not in done.stdout
    assert "ABLATIONS" in done.stderr


def test_an_ablation_word_is_a_run_setting_or_a_quality_flag() -> None:
    """`quality_session.sh multi`/`ablate`: KEY=VALUE becomes `--set KEY=VALUE`, a word
    starting with -- (e.g. --loops=untrain, a experiments/quality.py option) goes as it is."""
    script = (ROOT / "dev" / "gpu" / "quality_session.sh").read_text()
    start = script.index("as_args() {")
    function = script[start : script.index("\n}\n", start) + 3]
    words = "optim.epochs=2 --loops=untrain eval.every=0"
    done = subprocess.run(
        ["bash", "-c", f'{function}sets=(); for w in {words}; do as_args "$w"; done; '
         'printf "%s|" "${sets[@]}"'],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert done.stdout == "--set|optim.epochs=2|--loops=untrain|--set|eval.every=0|"


def _functions(script: str, *names: str) -> str:
    """The bodies of shell functions NAME() { ... } of a bench script, to run one alone."""
    text = (ROOT / "dev" / "gpu" / script).read_text()
    parts = []
    for name in names:
        start = text.index(f"{name}() {{")
        parts.append(text[start : text.index("\n}\n", start) + 3])
    return "".join(parts)


def test_a_checkpoint_sent_back_over_two_calls_restores_the_run_on_a_fresh_machine(
    tmp_path: Path,
) -> None:
    """`multi` with SEND_CKPT=NAME queues the newest complete checkpoint of an unfinished run
    in parts and sends what fits the return limit each call: the next call first the rest,
    then the parts of its own newest checkpoint that fit. `restore`, with the parts carried in
    .qckpt/ over two calls, puts back the newest whole checkpoint and the files resuming
    reads, and nothing else (not older, incomplete or partly sent checkpoints, not evals)."""
    functions = _functions(
        "quality_session.sh", "return_room", "send_checkpoints", "restore_checkpoints"
    )
    old = tmp_path / "old"
    files = {
        "runs/r6/metrics.jsonl": '{"step": 20}\n',
        "runs/r6.run.json": "{}",
        "runs/r6.log": "log",
        "stages/train-r6.json": '{"finished": false}',
        "runs/r6/checkpoints/step_00000500/COMPLETE": "",
        "runs/r6/checkpoints/step_00000500/drafter.safetensors": "older",
        "runs/r6/checkpoints/step_00001000/COMPLETE": "",
        "runs/r6/checkpoints/step_00001000/drafter.safetensors": os.urandom(45_000).hex(),
        "runs/r6/checkpoints/step_00001500/drafter.safetensors": os.urandom(45_000).hex(),
        "runs/r6/eval/chat.json": "{}",
    }
    for rel, text in files.items():
        (old / rel).parent.mkdir(parents=True, exist_ok=True)
        (old / rel).write_text(text)
    queue = tmp_path / "queue" / "r6"
    sent: dict[int, list[Path]] = {}
    for call in (1, 2):
        out = tmp_path / f"out{call}"
        out.mkdir()
        (out / "results.tar").write_bytes(b"r" * 5_000)
        done = subprocess.run(
            ["bash", "-c", f"{functions}send_checkpoints"],
            env={"PATH": "/usr/bin:/bin", "RUN_DIR": str(old), "OUT": str(out),
                 "SEND_CKPT": "r6 other", "CKPT_QUEUE": str(queue.parent),
                 "CKPT_PART_BYTES": "20000", "RETURN_BYTES": "50000"},
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        sent[call] = sorted(out.glob("ckpt_*"))
        assert sum(p.stat().st_size for p in out.iterdir()) <= 50_000, done.stdout
        if call == 1:  # the checkpoint of step 1500 completes meanwhile
            (old / "runs/r6/checkpoints/step_00001500/COMPLETE").write_text("")
    assert [p.name for p in sent[1]] == [f"ckpt_r6.step_00001000.tgz.part{s}" for s in ("aa", "ab")]
    assert [p.name for p in sent[2]] == [
        "ckpt_r6.step_00001000.tgz.partac", "ckpt_r6.step_00001500.tgz.partaa"
    ]  # fmt: skip
    left = sorted(p.name for p in queue.iterdir())  # for the next call
    assert left == [f"ckpt_r6.step_00001500.tgz.part{s}" for s in ("ab", "ac")]
    fresh = tmp_path / "fresh"
    carry = tmp_path / "repo" / ".qckpt"
    carry.mkdir(parents=True)
    env = {"PATH": "/usr/bin:/bin", "RUN_DIR": str(fresh), "CKPT_PARTS": str(tmp_path / "parts")}
    restore = f"{functions}restore_checkpoints"
    for part in [*sent[1], sent[2][1]]:  # the first carry call: not all parts of either
        shutil.copy(part, carry)
    out = subprocess.run(["bash", "-c", restore], cwd=carry.parent, env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout  # fmt: skip
    assert out.count("not whole yet") == 2 and not (fresh / "runs").exists(), out
    shutil.rmtree(carry)
    carry.mkdir()
    shutil.copy(sent[2][0], carry)  # the second carry call: the rest of step 1000's
    out = subprocess.run(["bash", "-c", restore], cwd=carry.parent, env=env, capture_output=True,
                         text=True, timeout=60, check=True).stdout  # fmt: skip
    assert "r6: restored" in out and "step_00001000" in out, out
    got = {str(p.relative_to(fresh)) for p in fresh.rglob("*") if p.is_file()}
    expect = {k for k in files if "00000500" not in k and "00001500" not in k and "eval" not in k}
    assert got == expect
    assert all((fresh / k).read_text() == files[k] for k in expect)


def test_a_peers_saved_state_comes_back_in_parts_and_restores_on_a_fresh_machine(
    tmp_path: Path,
) -> None:
    """A peer recipe (PEERS) named in SEND_CKPT: its state saved at the call's deadline
    (OUT/resume, experiments/peer_state.py) comes back in parts labelled with the step of its
    progress.json (the top-level one, not a history record's), with the files at the top of
    its folder and none of its other folders or the torn save a kill may leave (resume.new);
    a state left in resume.old alone (a kill between the swap's renames, where the peer
    resumes from too) comes back as resume.old. `restore` puts back the newest whole state
    of each peer where experiments/peer_recipe.py resumes from it (a real smoke peer cut, sent,
    restored and resumed gave the steps of a run in one go: dev/LOG.md, s37). A finished
    peer (its export) sends nothing."""
    functions = _functions(
        "quality_session.sh", "return_room", "send_checkpoints", "restore_checkpoints"
    )
    old = tmp_path / "old"
    history = [{"step": s, "loss": 1.0 / s} for s in (20, 40)]

    def progress(step: int) -> str:
        return json.dumps({"settings": {"seed": 1}, "step": step, "history": history})

    files = {
        "runs/peer6/run_config.json": "{}",
        "runs/peer6/metrics.jsonl": "".join(json.dumps(r) + "\n" for r in history),
        "runs/peer6/resume/progress.json": progress(4820),
        "runs/peer6/resume/optim.json": "{}",
        "runs/peer6/resume/state.safetensors": os.urandom(30_000).hex(),
        "runs/peer6/resume.old/progress.json": progress(2000),
        "runs/peer6/resume.new/state.safetensors": "torn",
        "runs/peer6/smoke/data/shard.bin": "inputs the next call rebuilds",
        "runs/cut/resume.old/progress.json": progress(7),
        "runs/cut/resume.old/state.safetensors": "cut between the renames",
        "runs/done/resume/progress.json": progress(9),
        "runs/done/export/config.json": "{}",
    }

    def write(changes: dict[str, str]) -> None:
        for rel, text in changes.items():
            (old / rel).parent.mkdir(parents=True, exist_ok=True)
            (old / rel).write_text(text)

    def send(call: int) -> tuple[list[str], str]:
        out = tmp_path / f"out{call}"
        out.mkdir()
        done = subprocess.run(
            ["bash", "-c", f"{functions}send_checkpoints"],
            env={"PATH": os.environ["PATH"], "RUN_DIR": str(old), "OUT": str(out),
                 "SEND_CKPT": "peer6 cut done", "CKPT_QUEUE": str(tmp_path / "queue"),
                 "CKPT_PART_BYTES": "20000", "RETURN_BYTES": "1000000"},
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        shutil.copytree(out, tmp_path / "repo" / ".qckpt", dirs_exist_ok=True)  # kept here
        return sorted(p.name for p in out.iterdir()), done.stdout

    write(files)
    sent, said = send(1)
    assert sent == [
        "ckpt_cut.step_00000007.tgz.partaa",
        *(f"ckpt_peer6.step_00004820.tgz.part{s}" for s in ("aa", "ab")),
    ], said  # fmt: skip
    assert not list((tmp_path / "queue").rglob("ckpt_*"))  # all sent: room for them all
    assert "runs/peer6/resume (step_00004820) queued" in said
    assert "runs/cut/resume.old (step_00000007) queued" in said
    # the next call: the peer went on and saved a newer state, whose parts come back too
    newer = {
        "runs/peer6/resume/progress.json": progress(9640),
        "runs/peer6/resume/state.safetensors": os.urandom(30_000).hex(),
    }
    write(newer)
    files.update(newer)
    sent, said = send(2)
    assert [n for n in sent if "peer6" in n] == [
        f"ckpt_peer6.step_00009640.tgz.part{s}" for s in ("aa", "ab")
    ], said  # fmt: skip
    fresh = tmp_path / "fresh"
    restored = subprocess.run(
        ["bash", "-c", f"{functions}restore_checkpoints"], cwd=tmp_path / "repo",
        env={"PATH": "/usr/bin:/bin", "RUN_DIR": str(fresh), "CKPT_PARTS": str(tmp_path / "parts")},
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert "peer6: restored step_00009640" in restored.stdout, restored
    assert (
        "step_00004820" not in restored.stdout and "cut: restored step_00000007" in restored.stdout
    )
    got = {str(p.relative_to(fresh)) for p in fresh.rglob("*") if p.is_file()}
    expect = {f"runs/peer6/{k}" for k in ("run_config.json", "metrics.jsonl")}
    expect |= {
        f"runs/peer6/resume/{k}" for k in ("progress.json", "optim.json", "state.safetensors")
    }
    expect |= {f"runs/cut/resume.old/{k}" for k in ("progress.json", "state.safetensors")}
    assert got == expect
    assert all((fresh / k).read_text() == files[k] for k in expect)  # the newest state's


def test_the_compile_cache_comes_back_once_with_a_carried_runs_export_not_beside_a_checkpoint(
    tmp_path: Path,
) -> None:
    """`collect` sends the compile cache (inductor.tar.xz.part*, for `cache` in a later
    session) once a machine, once a flashdraft training has compiled into it, and no larger
    than INDUCTOR_MAX_BYTES (45 MB). Under SEND_CKPT not in a call whose return is a
    checkpoint's, and only within RETURN_BYTES of what the call already returns: a run
    carried over calls sends it with its export, in its last call (until s40 a SEND_CKPT
    session never sent it, and each fresh machine compiled cold)."""
    functions = _functions(
        "quality_session.sh", "collect", "return_room", "send_checkpoints", "send_compile_cache"
    )
    run = tmp_path / "run"
    cache = tmp_path / "inductor-cache"
    cached = {"fxgraph/ab/graph": os.urandom(6_000), "triton/0/kernel.cubin": os.urandom(4_000)}
    step = run / "runs/r6/checkpoints/step_00000500"
    files = {**{cache / k: v for k, v in cached.items()}, step / "COMPLETE": b""}
    files[step / "drafter.safetensors"] = os.urandom(30_000)
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def collect(call: str, machine: str, **env: str) -> tuple[list[str], str]:
        out = tmp_path / call
        out.mkdir()
        done = subprocess.run(
            ["bash", "-c", f"{functions}collect"],
            env={"PATH": os.environ["PATH"], "RUN_DIR": str(run), "OUT": str(out),
                 "CKPT_QUEUE": str(tmp_path / "queue"), "CKPT_PART_BYTES": "20000",
                 "TORCHINDUCTOR_CACHE_DIR": str(cache),
                 "INDUCTOR_SENT": str(tmp_path / f"{machine}.sent"),
                 "INDUCTOR_XZ": str(tmp_path / "inductor.tar.xz"), **env},
            capture_output=True, text=True, timeout=60, check=True,
        )  # fmt: skip
        return sorted(p.name for p in out.iterdir()), done.stdout

    def cache_sent(sent: list[str]) -> bool:
        return any(n.startswith("inductor.tar.xz.part") for n in sent)

    # without SEND_CKPT: once a machine, within the cap
    sent, said = collect("plain1", "a", INDUCTOR_MAX_BYTES="1000")
    assert not cache_sent(sent) and "more than the 1000 bytes" in said
    sent, said = collect("plain2", "a")
    assert cache_sent(sent), said
    unpacked = tmp_path / "unpacked"
    unpacked.mkdir()
    subprocess.run(["tar", "xJf", str(tmp_path / "plain2" / "inductor.tar.xz.partaa"), "-C",
                    str(unpacked)], check=True, timeout=60)  # fmt: skip
    assert {
        str(p.relative_to(unpacked / "inductor-cache")): p.read_bytes()
        for p in unpacked.rglob("*") if p.is_file()
    } == cached  # fmt: skip
    assert not cache_sent(collect("plain3", "a")[0])
    # SEND_CKPT on another machine: mid-run the checkpoint fills the call's return
    carried = {"SEND_CKPT": "r6", "EXPORT_RUNS": "r6", "RETURN_BYTES": "1000000"}
    sent, said = collect("call1", "b", **carried)
    assert [n for n in sent if n.startswith("ckpt_")] == [
        "ckpt_r6.step_00000500.tgz.partaa", "ckpt_r6.step_00000500.tgz.partab"
    ], said  # fmt: skip
    assert not cache_sent(sent)
    # the run finished: its export comes back, and the cache only where it fits beside it
    (run / "runs/r6/export").mkdir()
    (run / "runs/r6/export/config.json").write_text("{}")
    (run / "runs/r6/export/model.safetensors").write_bytes(os.urandom(25_000))
    sent, said = collect("call2", "b", **{**carried, "RETURN_BYTES": "30000"})
    assert "export_r6.tgz.partaa" in sent and not cache_sent(sent) and "inductor cache" in said
    sent, said = collect("call2b", "b", **carried, INDUCTOR_MAX_BYTES="1000")  # the cap too
    assert not cache_sent(sent) and "more than the 1000 bytes" in said
    sent, said = collect("call3", "b", **carried)
    assert sent == ["export_r6.tgz.partaa", "inductor.tar.xz.partaa", "results.tar"], said
    assert not cache_sent(collect("call4", "b", **carried)[0])  # once a machine


def test_multi_in_sequence_starts_a_run_only_after_the_one_before_completes(
    tmp_path: Path,
) -> None:
    """`multi` with MULTI_SEQUENCE=1 (a run that prunes another's export needs it finished):
    each run starts after the one before has ended complete; an incomplete run (its
    deadline came) leaves the later ones for the next call. experiments/quality.py is a stand-in
    here that logs its start and end and is complete unless its run is named `cut*`."""
    fake = tmp_path / "experiments" / "quality.py"
    fake.parent.mkdir()
    fake.write_text(textwrap.dedent('''
        import json, os, sys, time
        run = sys.argv[sys.argv.index("--run") + 1]
        with open(os.environ["CALLS"], "a") as f:
            f.write(f"start {run} {' '.join(sys.argv[1:])}\\n")
        time.sleep(0.3)
        with open(os.environ["CALLS"], "a") as f:
            f.write(f"end {run}\\n")
        print(json.dumps({"complete": not run.startswith("cut"), "run": run}))
    '''))  # fmt: skip
    (tmp_path / "site").mkdir()
    calls = tmp_path / "calls.txt"
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "HOME": str(tmp_path),
           "SITE": str(tmp_path / "site"), "CALLS": str(calls), "MULTI_SEQUENCE": "1",
           "MULTI_MIN": "1", "STAGGER_MAX": "1", "QUALITY_ARGS": "--smoke"}  # fmt: skip
    script = str(ROOT / "dev" / "gpu" / "quality_session.sh")

    def multi(ablations: str) -> list[str]:
        calls.write_text("")
        done = subprocess.run(
            ["bash", script, "multi"], cwd=tmp_path, env={**env, "ABLATIONS": ablations},
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, (done.stdout, done.stderr)
        return [" ".join(line.split()[:2]) for line in calls.read_text().splitlines()]

    events = multi("ref6 loss.anchors=512;small --prune-from=ref6 optim.epochs=2")
    assert events == ["start ref6", "end ref6", "start small", "end small"]
    started = [line for line in calls.read_text().splitlines() if line.startswith("start small")]
    assert "--prune-from=ref6 --set optim.epochs=2" in started[0]
    assert multi("cut1 optim.epochs=2;after optim.epochs=2") == ["start cut1", "end cut1"]


def test_the_peer_stage_trains_then_evaluates_with_the_runs_eval_stage(tmp_path: Path) -> None:
    """`quality_session.sh peer`: experiments/peer_recipe.py trains (no --eval-prompts of its own),
    and once its report exists experiments/quality.py's eval stage evaluates the export as it does
    the runs (same prompts, QUALITY_ARGS), so `compare` pairs them prompt by prompt; a peer
    stopped for its deadline is not evaluated, and a call that finds it trained only
    evaluates. Both scripts are stand-ins that log their arguments."""
    bench = tmp_path / "experiments"
    bench.mkdir()
    (bench / "peer_recipe.py").write_text(textwrap.dedent('''
        import json, os, pathlib, sys
        with open(os.environ["CALLS"], "a") as f:
            f.write("peer_recipe " + " ".join(sys.argv[1:]) + "\\n")
        if not os.environ.get("CUT"):
            out = pathlib.Path(sys.argv[sys.argv.index("--output") + 1])
            out.mkdir(parents=True, exist_ok=True)
            (out / "report.json").write_text(json.dumps({"complete": True, "output": str(out)}))
    '''))  # fmt: skip
    (bench / "quality.py").write_text(textwrap.dedent('''
        import os, sys
        with open(os.environ["CALLS"], "a") as f:
            f.write("quality " + " ".join(sys.argv[1:]) + "\\n")
        print("eval chat: tau 2.000 on 24 prompts")
    '''))  # fmt: skip
    (tmp_path / "site").mkdir()
    calls, run_dir = tmp_path / "calls.txt", tmp_path / "run"
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "HOME": str(tmp_path),
           "SITE": str(tmp_path / "site"), "CALLS": str(calls), "RUN_DIR": str(run_dir),
           "QUALITY_ARGS": "--gpus 1 --no-zlab-parity", "PEER_ARGS": "--epochs 2"}  # fmt: skip
    script = str(ROOT / "dev" / "gpu" / "quality_session.sh")

    def peer(**extra: str) -> list[str]:
        calls.write_text("")
        done = subprocess.run(
            ["bash", script, "peer"], cwd=tmp_path, env={**env, **extra}, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
        assert done.returncode == 0, (done.stdout, done.stderr)
        return calls.read_text().splitlines()

    (cut,) = peer(CUT="1")  # the deadline: what is left of 555 s, less 20 to save its state
    words = cut.split()
    assert 520 <= int(words[words.index("--deadline") + 1]) <= 535
    assert cut.endswith(f"--data {run_dir}/data --output {run_dir}/runs/peer-speculators")
    (trained, evaluated) = peer()
    assert trained.startswith("peer_recipe --epochs 2") and "--eval-prompts" not in trained
    assert evaluated.startswith("quality eval --run peer-speculators --deadline ")
    assert f"--output {run_dir} " in evaluated
    assert evaluated.endswith(f"--bench-dir {tmp_path}/out --gpus 1 --no-zlab-parity")
    # trained already: peer_recipe checks its settings (and trains nothing), then the eval
    checked, again = peer()
    assert checked.startswith("peer_recipe --epochs 2")
    assert again.startswith("quality eval --run peer-speculators")
    assert (tmp_path / "out" / "peer_report.json").exists()
    assert peer(PEER_DEADLINE="100") == []  # under PEER_MIN left: nothing starts
    # a second peer beside the first (its seed noise): its own folder, its own eval
    os.remove(tmp_path / "out" / "peer_report.json")
    trained, evaluated = peer(PEER_NAME="peer-seed1", PEER_ARGS="--epochs 2 --seed 1")
    assert trained.startswith("peer_recipe --epochs 2 --seed 1 ")
    assert trained.endswith(f"--output {run_dir}/runs/peer-seed1")
    assert evaluated.startswith("quality eval --run peer-seed1 --deadline ")
    assert (run_dir / "runs" / "peer-speculators" / "report.json").exists()
    copied = json.loads((tmp_path / "out" / "peer_report.json").read_text())
    assert copied["output"] == f"{run_dir}/runs/peer-seed1"  # its own report comes back


def _session_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a `quality_session.sh` call with stand-in scripts in tmp_path/bench:
    a machine that ran `one` (SITE exists), calls logged to tmp_path/calls.txt."""
    (tmp_path / "site").mkdir(exist_ok=True)
    return {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "HOME": str(tmp_path),
            "SITE": str(tmp_path / "site"), "CALLS": str(tmp_path / "calls.txt"),
            "RUN_DIR": str(tmp_path / "run"), "QUALITY_ARGS": "--gpus 1", "MULTI_MIN": "1",
            **extra}  # fmt: skip


def _session(tmp_path: Path, stage: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """dev/gpu/quality_session.sh STAGE run in tmp_path (where its stand-ins are) under env."""
    return subprocess.run(
        ["bash", str(ROOT / "dev" / "gpu" / "quality_session.sh"), stage], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_multi_runs_several_peers_side_by_side_each_with_its_own_folder_and_logs(
    tmp_path: Path,
) -> None:
    """`multi` with PEERS="NAME FLAGS...;...": each peer recipe trains into its own run folder
    with its own flags, beside the others, and is then evaluated by the runs' eval stage
    under its name; each keeps its own logs in multi.tgz; ABLATIONS may be empty then, and
    neither set is a one-line error. Both scripts are stand-ins that log their arguments."""
    bench = tmp_path / "experiments"
    bench.mkdir()
    (bench / "peer_recipe.py").write_text(textwrap.dedent('''
        import json, os, pathlib, sys
        with open(os.environ["CALLS"], "a") as f:
            f.write("peer_recipe " + " ".join(sys.argv[1:]) + "\\n")
        out = pathlib.Path(sys.argv[sys.argv.index("--output") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text(json.dumps({"output": str(out)}))
        print("trained " + out.name)
    '''))  # fmt: skip
    (bench / "quality.py").write_text(textwrap.dedent('''
        import os, sys
        with open(os.environ["CALLS"], "a") as f:
            f.write("quality " + " ".join(sys.argv[1:]) + "\\n")
        print("eval chat: tau 2.000 on 24 prompts, run " + sys.argv[sys.argv.index("--run") + 1])
    '''))  # fmt: skip
    calls, run_dir, out = tmp_path / "calls.txt", tmp_path / "run", tmp_path / "out"
    env = _session_env(
        tmp_path, PEERS="pa --epochs 2 --anchors 512;pb --epochs 2 --anchors 512 --seed 1"
    )
    done = _session(tmp_path, "multi", env)
    assert done.returncode == 0, (done.stdout, done.stderr)
    lines = calls.read_text().splitlines()
    trained = sorted(line for line in lines if line.startswith("peer_recipe"))
    assert len(trained) == 2
    assert trained[0].startswith("peer_recipe --epochs 2 --anchors 512 --deadline ")
    assert trained[0].endswith(f"--output {run_dir}/runs/pa")
    assert trained[1].startswith("peer_recipe --epochs 2 --anchors 512 --seed 1 --deadline ")
    assert trained[1].endswith(f"--output {run_dir}/runs/pb")
    evaluated = sorted(line.split("--deadline")[0] for line in lines if line.startswith("quality"))
    assert evaluated == ["quality eval --run pa ", "quality eval --run pb "]
    assert "== pa" in done.stdout and "== pb" in done.stdout
    with tarfile.open(out / "multi.tgz") as archive:
        logs = {Path(name).name: archive.extractfile(name) for name in archive.getnames()}
        texts = {k: v.read().decode() for k, v in logs.items() if v is not None}
    assert "trained pa" in texts["pa.txt"] and "trained pb" in texts["pb.txt"]
    assert "run pa" in texts["pa_eval.txt"] and "run pb" in texts["pb_eval.txt"]
    nothing = _session(tmp_path, "multi", {**env, "PEERS": ""})
    assert nothing.returncode == 2 and "ABLATIONS" in nothing.stderr and "PEERS" in nothing.stderr
    # a name twice, `peer` (the logs of PEER_BESIDE's), a run's name, no name (flags first)
    for clash, extra in (("pa --epochs 2;pa --seed 1", {}), ("peer --epochs 2", {}),
                         ("r1 --epochs 2", {"ABLATIONS": "r1 optim.epochs=2"}),
                         ("--epochs 2", {})):  # fmt: skip
        refused = _session(tmp_path, "multi", {**env, "PEERS": clash, **extra})
        assert refused.returncode == 2 and "is not a free run name" in refused.stderr, clash


def test_the_peer_wheels_install_once_for_every_peer_of_a_call(tmp_path: Path) -> None:
    """`multi` with PEER_BESIDE=1 and PEERS: the carried .whl/peers is installed once, before
    any peer starts (peers installing at once would write over each other), and not again
    by a later call on the same machine with the same wheels; other wheels are installed;
    the one beside keeps its folder and logs (peer-speculators, multi/peer.txt); a PEERS
    name taken by it is refused; wheels that fail to install are said on stdout, start no
    peer and are tried again by the next call. pip and both scripts are stand-ins that log
    their calls."""
    bench = tmp_path / "experiments"
    bench.mkdir()
    (bench / "peer_recipe.py").write_text(textwrap.dedent('''
        import json, os, pathlib, sys
        out = pathlib.Path(sys.argv[sys.argv.index("--output") + 1])
        with open(os.environ["CALLS"], "a") as f:
            f.write(f"peer_recipe {out.name} {os.environ['PYTHONPATH'].split(':')[0]}\\n")
        out.mkdir(parents=True, exist_ok=True)
        (out / "report.json").write_text("{}")
        print("trained " + out.name)
    '''))  # fmt: skip
    (bench / "quality.py").write_text("print('eval')\n")
    pip = tmp_path / "pip.sh"  # --target DIR WHEEL...: logs, takes a while, installs
    pip.write_text(
        'echo "pip $(basename "$3")" >> "$CALLS"; sleep 0.5; mkdir -p "$2"; touch "$2/ok"\n'
    )
    (tmp_path / ".whl" / "peers").mkdir(parents=True)
    (tmp_path / ".whl" / "peers" / "a-1-py3-none-any.whl").write_text("")
    calls, site = tmp_path / "calls.txt", tmp_path / "peer-site"
    env = _session_env(
        tmp_path, PIP_INSTALL=f"bash {pip}", PEER_SITE=str(site), PEER_BESIDE="1",
        PEER_ARGS="--epochs 2", PEERS="pa --epochs 2;pb --epochs 2 --seed 1",
    )  # fmt: skip

    def multi(**extra: str) -> list[str]:
        calls.write_text("")
        done = _session(tmp_path, "multi", {**env, **extra})
        assert done.returncode == 0, (done.stdout, done.stderr)
        return calls.read_text().splitlines()

    first, *rest = multi()
    assert first == "pip a-1-py3-none-any.whl"  # before any peer started
    assert sorted(rest) == [
        f"peer_recipe pa {site}", f"peer_recipe pb {site}", f"peer_recipe peer-speculators {site}"
    ]  # fmt: skip
    with tarfile.open(tmp_path / "out" / "multi.tgz") as archive:
        names = {Path(name).name for name in archive.getnames()}
    assert {"peer.txt", "pa.txt", "pb.txt"} <= names
    assert not any(line.startswith("pip") for line in multi())  # the same wheels: installed
    (tmp_path / ".whl" / "peers" / "b-1-py3-none-any.whl").write_text("")
    assert sum(line.startswith("pip") for line in multi()) == 1  # other wheels: once again
    refused = _session(tmp_path, "multi", {**env, "PEERS": "peer-speculators --epochs 2"})
    assert refused.returncode == 2 and "'peer-speculators' is not a free" in refused.stderr
    # wheels that do not install: said on stdout, no peer starts, the next call tries again
    pip.write_text('echo "pip $(basename "$3")" >> "$CALLS"; exit 1\n')
    (tmp_path / ".whl" / "peers" / "c-1-py3-none-any.whl").write_text("")
    for _ in range(2):
        calls.write_text("")
        done = _session(tmp_path, "multi", env)
        assert done.returncode == 0 and "did not install" in done.stdout, done.stdout
        assert calls.read_text().splitlines() == ["pip a-1-py3-none-any.whl"]


def test_multi_spreads_peers_and_runs_over_the_gpus_in_start_order(tmp_path: Path) -> None:
    """On the x2 machine (MULTI_GPUS="0 1") the peer beside, the PEERS and the runs take the
    GPUs in turn, in the order they start, from one count: two jobs never both sit on GPU 0
    while GPU 1 idles. Both scripts are stand-ins that log their GPU."""
    bench = tmp_path / "experiments"
    bench.mkdir()
    log = """
        import json, os, pathlib, sys
        name = sys.argv[sys.argv.index("--run" if "--run" in sys.argv else "--output") + 1]
        with open(os.environ["CALLS"], "a") as f:
            f.write(f"{pathlib.Path(name).name} {os.environ.get('CUDA_VISIBLE_DEVICES')}\\n")
        if "--run" not in sys.argv:  # the peer: its report says it is trained
            pathlib.Path(name).mkdir(parents=True, exist_ok=True)
            (pathlib.Path(name) / "report.json").write_text("{}")
        print(json.dumps({"complete": True}))
    """
    (bench / "peer_recipe.py").write_text(textwrap.dedent(log))
    (bench / "quality.py").write_text(textwrap.dedent(log))
    env = _session_env(
        tmp_path, MULTI_GPUS="0 1", PEER_BESIDE="1", PEERS="pa --epochs 2;pb --epochs 2",
        ABLATIONS="r1 optim.epochs=2;r2 optim.epochs=2",
    )  # fmt: skip
    done = _session(tmp_path, "multi", env)
    assert done.returncode == 0, (done.stdout, done.stderr)
    placed = sorted(
        set((tmp_path / "calls.txt").read_text().splitlines())
    )  # a peer's eval runs on its GPU too
    assert placed == ["pa 1", "pb 0", "peer-speculators 0", "r1 1", "r2 0"]


def test_two_names_the_missing_gguf_part_before_any_work(tmp_path: Path) -> None:
    """`two` without its part of the GGUF (s25 sent it without its carry) says in one line how
    many bytes it has and what to carry, instead of a checksum failure that reads like a lost
    machine; without the first part (kept by `one`) it says to start again with `one`."""
    parts, site = tmp_path / "parts", tmp_path / "site"
    parts.mkdir()
    site.mkdir()
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "HOME": str(tmp_path),
           "SITE": str(site), "GGUF_PARTS": str(parts)}  # fmt: skip

    def two() -> str:
        done = subprocess.run(
            ["bash", str(ROOT / "dev" / "gpu" / "quality_session.sh"), "two"], cwd=tmp_path, env=env,
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 1, (done.stdout, done.stderr)
        (line,) = done.stdout.strip().splitlines()
        return line

    (parts / "partab").write_bytes(b"x" * 10)  # this call's part, on a fresh machine
    line = two()
    assert "first part is not here (10 of 98362432 bytes" in line and "call one" in line
    (parts / "partab").unlink()
    (parts / "partaa").write_bytes(b"x" * 1000)  # what `one` left; this call carried nothing
    line = two()
    assert "1000 of 98362432 bytes" in line and "(partaa)" in line and ".gguf/partab" in line


def test_peereval_evaluates_several_carried_exports_in_turn_after_checking_them_all(
    tmp_path: Path,
) -> None:
    """`peereval` with PEER_NAME="A B": each carried export (.qpeer/export_NAME.tgz.part*, a
    tar of export/ in parts) is unpacked into its own run folder and evaluated in turn by the
    eval stage, each with its own log, in one call (so their times compare); a name whose
    export was not carried stops the call in one line before any eval."""
    bench = tmp_path / "experiments"
    bench.mkdir()
    (bench / "quality.py").write_text(textwrap.dedent('''
        import os, sys
        with open(os.environ["CALLS"], "a") as f:
            f.write("quality " + " ".join(sys.argv[1:]) + "\\n")
        print("eval chat: tau 2.000 on 24 prompts")
    '''))  # fmt: skip
    qpeer = tmp_path / ".qpeer"
    qpeer.mkdir()
    for name in ("a", "b"):
        export = tmp_path / "src" / name / "export"
        export.mkdir(parents=True)
        (export / "config.json").write_text(json.dumps({"drafter": name}))
        packed = tmp_path / f"{name}.tgz"
        with tarfile.open(packed, "w:gz") as archive:
            archive.add(export, arcname="export")
        data = packed.read_bytes()  # two parts, as split(1) leaves them
        (qpeer / f"export_{name}.tgz.partaa").write_bytes(data[: len(data) // 2])
        (qpeer / f"export_{name}.tgz.partab").write_bytes(data[len(data) // 2 :])
    (qpeer / "peer_report.json").write_text("{}")
    env = _session_env(tmp_path, PEER_NAME="a b", PEER_DEADLINE="200")
    done = _session(tmp_path, "peereval", env)
    assert done.returncode == 0, (done.stdout, done.stderr)
    calls = (tmp_path / "calls.txt").read_text().splitlines()
    assert [c.split()[:5] for c in calls] == [
        ["quality", "eval", "--run", "a", "--deadline"],
        ["quality", "eval", "--run", "b", "--deadline"],
    ]
    for name in ("a", "b"):
        run = tmp_path / "run" / "runs" / name
        assert json.loads((run / "export" / "config.json").read_text()) == {"drafter": name}
        assert (run / "report.json").read_text() == "{}"
        assert (tmp_path / "out" / f"peereval_{name}.txt").exists()
    (tmp_path / "calls.txt").write_text("")
    done = _session(tmp_path, "peereval", {**env, "PEER_NAME": "a c"})
    assert done.returncode == 1
    assert done.stdout.strip().splitlines()[-1] == (
        "== peereval: carry .qpeer with export_c.tgz.part* and peer_report.json"
    )
    assert (tmp_path / "calls.txt").read_text() == ""  # nothing evaluated, not even `a`


def test_the_ahead_stage_narrows_to_a_runs_own_shapes(tmp_path: Path) -> None:
    """`fast_session.sh ahead`: by default every shape (A = 512 and 2,048, R = 1, 4, 10,
    the 8,192-row LM-head chunks); AHEAD_A / AHEAD_R / AHEAD_CHUNKS=0 leave one run's shapes
    only. A stand-in python3 records each bench/trainer.py command line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.txt"
    stub = bin_dir / "python3"
    stub.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n')
    stub.chmod(0o755)
    script = str(ROOT / "dev" / "gpu" / "fast_session.sh")

    def commands(**extra: str) -> list[str]:
        calls.unlink(missing_ok=True)
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "OUT": str(tmp_path / "out"), **extra}
        done = subprocess.run(
            ["bash", script, "ahead"], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=60, check=True,
        )  # fmt: skip
        assert "== ahead done in" in done.stdout
        return calls.read_text().splitlines()

    every = commands()
    assert len(every) == 7 and all(c.startswith("bench/trainer.py") for c in every)
    assert sum("--chunk-rows 8192" in c for c in every) == 1
    narrow = commands(AHEAD_A="2048", AHEAD_R="1 10", AHEAD_CHUNKS="0")
    assert len(narrow) == 2
    for line, rows in zip(narrow, (1, 10), strict=True):
        assert "--anchors 2048" in line and f"target.forward_rows={rows}" in line
        assert "drafter.intermediate_size=704" in line and "--chunk-rows" not in line
