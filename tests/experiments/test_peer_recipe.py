"""experiments/peer_recipe.py: the peer trains on the rows of experiments/quality.py's run, and (slow,
speculators installed) the whole recipe in its smoke size: train, export, load, eval."""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest
from helpers import script_modules, speculators_oracle

from flashdraft import config as cfg
from flashdraft.train.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench() -> dict[str, ModuleType]:
    """experiments/peer_recipe.py with its settings (peer_config) and saved state (peer_state), and
    experiments/quality.py with its report module, as modules (they import their neighbours)."""
    return script_modules(
        "experiments", "peer_recipe", "peer_config", "peer_state", "quality", "quality_report"
    )


def test_the_peer_trains_on_the_rows_of_the_quality_run(
    bench: dict[str, ModuleType], tmp_path: Path
) -> None:
    """Same data, target, packing, anchors budget, drafter geometry, seed and steps as the
    run config experiments/quality.py's train stage builds: only where it writes and the
    in-training eval differ (speculators' Trainer has none)."""
    common = ["--target", "/models/smol", "--steps", "100", "--device", "cpu"]
    _, quality_config, _ = bench["quality"].parse(["train", "--output", str(tmp_path), *common])
    ours = bench["quality"].Pipeline(quality_config, []).run_config().to_dict()
    config = bench["peer_recipe"].parse(
        ["--data", str(tmp_path / "data"), "--output", str(tmp_path / "peer"), *common]
    )
    assert config.data is not None
    theirs = bench["peer_config"].run_config(config, config.data, "/models/smol", "cpu").to_dict()
    assert theirs["eval"]["every"] == 0
    for run in (ours, theirs):
        del run["output"], run["eval"]
    assert theirs == ours


def test_the_caveats_describe_flashdraft_from_the_run_config(
    bench: dict[str, ModuleType], tmp_path: Path
) -> None:
    """The report's caveats read flashdraft's loss and optimizer from the run config they
    get (`run_config`'s: the preset the quality runs start from): its Muon and soft labels
    (s29 found them printed as "AdamW" and "CE" whatever the run used), and other settings
    when the config says so."""
    peer = bench["peer_config"]
    common = ["--data", str(tmp_path / "d"), "--output", "o", "--target", "/m", "--device", "cpu"]
    config = bench["peer_recipe"].parse(common)
    preset = peer.run_config(config, config.data, "/m", "cpu")
    loss, optim = peer.flashdraft_loss_text(preset), peer.flashdraft_optim_text(preset)
    assert loss.startswith(
        "KL to the target's top-32 distribution with 0.5 of its argmax mixed in, D-PACE slot "
        "weights (alpha 0.5), normalised by the global trained-slot count sum(m)"
    )
    assert optim.startswith("muon (lr 0.001, momentum 0.95, weight decay 0.1) on the 2-D")
    assert optim.endswith(
        "linear schedule with 139 warmup steps to 0.0 of the lr at the last step, clip 1.0"
    )
    words = ["loss.weighting=decay", "loss.argmax_mix=0", "optim.optimizer=adamw"]
    moved = cfg.build(RunConfig, cfg.apply_overrides(preset.to_dict(), words))
    decay = peer.flashdraft_loss_text(moved)  # gamma unset: 7 for B = 16
    assert decay.startswith("KL to the target's top-32 distribution, exp(-(k-1)/7.0) slot decay")
    assert decay.endswith("normalised by the global weight sum sum(w m)")
    assert peer.flashdraft_optim_text(moved).startswith("AdamW lr 0.001 (betas [0.9, 0.95]")
    words = ["loss.labels=target", "loss.argmax_mix=0", "loss.weighting=decay"]
    hard = cfg.build(
        RunConfig, cfg.apply_overrides(preset.to_dict(), [*words, "drafter.block_size=8"])
    )
    assert peer.flashdraft_loss_text(hard).startswith("CE on the target tokens, exp(-(k-1)/3.5)")
    speculators_oracle()
    flat = {**peer.speculators_settings(), "epochs": 20}
    lines = peer.caveats(flat, preset)
    assert any(f"flashdraft: {optim}." in line for line in lines)
    assert any(f"flashdraft: {loss}." in line for line in lines)


def test_peer_epochs_give_the_run_of_an_epochs_ablation(
    bench: dict[str, ModuleType], tmp_path: Path
) -> None:
    """`--epochs 2` builds the run an ablation `--set optim.epochs=2` trains (so the two count
    the same steps over the same rows), and differs from the preset's own epochs."""
    common = ["--target", "/models/smol", "--device", "cpu"]
    argv = ["train", "--output", str(tmp_path), *common, "--set", "optim.epochs=2"]
    _, quality_config, sets = bench["quality"].parse(argv)
    ours = bench["quality"].Pipeline(quality_config, sets).run_config().to_dict()
    peer = bench["peer_config"]
    runs = {}
    for extra in ([], ["--epochs", "2"]):
        config = bench["peer_recipe"].parse(
            ["--data", str(tmp_path / "data"), "--output", "o", *common, *extra]
        )
        assert config.data is not None
        runs[len(extra)] = peer.run_config(config, config.data, "/models/smol", "cpu").to_dict()
    assert ours["optim"]["epochs"] == runs[2]["optim"]["epochs"] == 2
    assert runs[0]["optim"]["epochs"] != 2
    for run in (ours, runs[2]):
        del run["output"], run["eval"]
    assert runs[2] == ours


def test_the_peers_drafter_shape_is_the_shape_ablations(
    bench: dict[str, ModuleType], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--drafter num_layers=6 intermediate_size=512 target_layer_ids=[...]` builds the run a
    quality ablation with the same words under `--set drafter.` trains (s44's `l6m512`), so
    the peer trains that shape over the same rows and taps (speculators' ids one up); without
    it the peer trains the preset's shape (7 x 352 since s45, 5 x 704 before); a key
    outside the shape, a word without `=` or a key given twice is a one-line error naming
    it. The shape reaches what speculators builds: the drafter config of the run (on a
    SmolLM2-shaped target config) gives its overrides and its layers' Qwen3 config."""
    import torch
    from transformers import LlamaConfig

    from flashdraft.export import to_speculators_config
    from flashdraft.train.plan import build_drafter_config

    common = ["--target", "/models/smol", "--device", "cpu"]
    shape = ["num_layers=6", "intermediate_size=512", "target_layer_ids=[1,8,14,20,27]"]
    sets = [word for item in shape for word in ("--set", f"drafter.{item}")]
    argv = ["train", "--output", str(tmp_path), *common, "--set", "optim.epochs=2", *sets]
    _, quality_config, overrides = bench["quality"].parse(argv)
    ours = bench["quality"].Pipeline(quality_config, overrides).run_config().to_dict()
    peer = bench["peer_config"]
    config = bench["peer_recipe"].parse(
        ["--data", str(tmp_path / "data"), "--output", "o", *common, "--epochs", "2",
         "--drafter", *shape]
    )  # fmt: skip
    assert config.data is not None
    run = peer.run_config(config, config.data, "/models/smol", "cpu")
    theirs = run.to_dict()
    assert (theirs["drafter"]["num_layers"], theirs["drafter"]["intermediate_size"]) == (6, 512)
    for one in (ours, theirs):
        del one["output"], one["eval"]
    assert theirs == ours
    preset = peer.run_config(
        bench["peer_recipe"].parse(["--data", "d", "--output", "o", *common]), "d", "/m", "cpu"
    )
    assert (preset.drafter.num_layers, preset.drafter.intermediate_size) == (7, 352)
    assert preset.drafter.target_layer_ids == [1, 8, 14, 20, 27]
    smol = LlamaConfig(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, vocab_size=49152,
    )  # fmt: skip
    masked = cfg.build(RunConfig, cfg.apply_overrides(run.to_dict(), ["drafter.mask_token_id=16"]))
    drafter, _ = build_drafter_config(masked, smol)
    flat = peer.peer_overrides(config, masked, drafter, torch.device("cpu"))
    assert (flat["num_layers"], flat["target_layer_ids"]) == (6, [2, 9, 15, 21, 28])
    layers = to_speculators_config(drafter, "/m")["transformer_layer_config"]
    assert (layers["num_hidden_layers"], layers["intermediate_size"]) == (6, 512)
    bad_words = {
        "block_size=8": "block_size=8",
        "num_layers": "expected KEY=VALUE",
        "num_layers=7 num_layers=6": "num_layers is given twice",
    }
    for bad, said in bad_words.items():
        with pytest.raises(SystemExit):
            bench["peer_recipe"].parse(["--data", "d", "--output", "o", "--drafter", *bad.split()])
        assert said in capsys.readouterr().err
    speculators_oracle()  # the report says which shape the peer trained
    lines = peer.caveats({**peer.speculators_settings(), "epochs": 20}, run)
    assert any("the flashdraft run's drafter (6 layers, MLP 512," in line for line in lines)


def test_the_peers_anchors_are_the_runs_unless_given(
    bench: dict[str, ModuleType], tmp_path: Path
) -> None:
    """The peer draws as many anchors per row as the flashdraft run (the preset's 2048) unless
    `--anchors N` sets its own (512: speculators' default, what the s15 peer ran at); the
    flashdraft side of the comparison is the same run either way. Its seed is speculators'
    own (42, left in its settings) unless `--seed N` replaces it (the peer's seed noise)."""
    from types import SimpleNamespace

    import torch

    peer = bench["peer_config"]
    drafter = SimpleNamespace(
        num_hidden_layers=5, block_size=16, target_layer_ids=[1, 8], mask_token_id=0,
        vocab_size=10,
    )  # fmt: skip
    common = ["--target", "/models/smol", "--device", "cpu", "--data", str(tmp_path / "d")]
    got = {}
    flags = {"default": [], "a512": ["--anchors", "512"], "seed7": ["--seed", "7"]}
    for name, extra in flags.items():
        config = bench["peer_recipe"].parse([*common, "--output", "o", *extra])
        assert config.data is not None
        run = peer.run_config(config, config.data, "/models/smol", "cpu")
        assert run.loss.anchors == 2048
        got[name] = peer.peer_overrides(config, run, drafter, torch.device("cpu"))
    assert (got["default"]["max_anchors"], got["a512"]["max_anchors"]) == (2048, 512)
    assert {k: v for k, v in got["default"].items() if k != "max_anchors"} == {
        k: v for k, v in got["a512"].items() if k != "max_anchors"
    }
    assert "seed" not in got["default"] and peer.speculators_settings()["seed"] == 42
    assert got["seed7"] == {**got["default"], "seed": 7}


def test_the_peer_is_evaluated_on_the_eval_stages_prompts(
    bench: dict[str, ModuleType], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--eval-prompts FILE` evaluates the prompts experiments/quality.py's eval stage picks of
    FILE (spread over sources, not its first N), and the report names each prompt's source:
    `compare` pairs the peer with the runs prompt by prompt (s25: the first 24 of the chat
    file came from 8 conversations, the eval stage's 24 from 24)."""
    peer, quality_report = bench["peer_recipe"], bench["quality_report"]
    held_out = tmp_path / "held_out" / "chat.jsonl"
    held_out.parent.mkdir()
    sources = ["a", "a", "a", "b", "c", "c"]
    held_out.write_text(
        "".join(json.dumps({"id": f"p{i}", "source": s}) + "\n" for i, s in enumerate(sources))
    )
    seen = {}

    def fake_eval(config, *_):  # the loop itself is tested with flashdraft eval
        ids = [json.loads(line)["id"] for line in Path(config.prompts).read_text().splitlines()]
        seen["ids"] = ids
        return {"tau": 2.0, "num_prompts": len(ids), "per_prompt": [{"id": i} for i in ids]}

    monkeypatch.setattr(peer, "load_eval_target", lambda config: (None, None))
    monkeypatch.setattr(peer, "load_drafter", lambda path: None)
    monkeypatch.setattr(peer, "run_eval", fake_eval)

    def write_json(report, path):  # the JSON only (the real one also plots the acceptance)
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report))

    monkeypatch.setattr(peer, "write_report", write_json)
    output = tmp_path / "peer"
    config = bench["peer_recipe"].parse(["--output", str(output), "--data", "d", "--eval-prompts", str(held_out),
                         "--eval-limit", "3", "--device", "cpu"])  # fmt: skip
    result = peer.evaluate(config, "target", tmp_path / "export", "cpu")
    assert seen["ids"] == ["p0", "p3", "p4"]  # one per source first
    stage = tmp_path / "stage.jsonl"
    quality_report.write_spread_subset(held_out, stage, 3)  # what the eval stage evaluates
    assert [json.loads(x)["id"] for x in stage.read_text().splitlines()] == seen["ids"]
    report = json.loads((output / "eval" / "chat.json").read_text())
    assert [p["source"] for p in report["per_prompt"]] == ["a", "b", "c"]
    assert result is not None and result["chat"]["tau"] == 2.0


def test_a_saved_state_survives_a_kill_while_saving(
    bench: dict[str, ModuleType], tmp_path: Path
) -> None:
    """`--save-every` saves while training goes on: each save replaces the last one whole, a
    save killed before its swap leaves the earlier state, and one killed between the swap's
    two renames is found in resume.old."""
    import torch

    peer = bench["peer_state"]
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    folder, settings = tmp_path / "resume", {"seed": 1}

    def save(step: int) -> None:
        with torch.no_grad():
            model.weight.fill_(float(step))
        progress = {"settings": settings, "step": step, "train_s": 1.0}
        peer.save_progress(folder, progress, model, [optimizer], [scheduler])

    def load() -> int:
        done = peer.load_progress(folder, settings, model, [optimizer], [scheduler])
        assert done is not None and model.weight[0, 0].item() == done["step"]
        return int(done["step"])

    save(1)
    save(2)
    assert load() == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["resume"]
    (tmp_path / "resume.new").mkdir()  # a save killed while writing its files
    (tmp_path / "resume.new" / "state.safetensors").write_bytes(b"torn")
    assert load() == 2
    folder.rename(tmp_path / "resume.old")  # killed between the swap's renames
    assert load() == 2
    save(3)
    assert load() == 3 and sorted(p.name for p in tmp_path.iterdir()) == ["resume"]
    with pytest.raises(ValueError, match="other settings"):
        peer.load_progress(folder, {"seed": 2}, model, [optimizer], [scheduler])


@pytest.mark.slow
def test_the_speculators_recipe_runs_in_its_smoke_size(
    tmp_path: Path, tiny_qwen3_dir: Path
) -> None:
    """speculators' DFlash trained on flashdraft's rows and taps of a tiny random target: the
    loss falls, its labels are the target's argmax, its own checkpoint and the dflash export
    load through flashdraft's loader as the same drafter, the held-out eval runs; a second
    call finds the training done and only evaluates."""
    speculators_oracle()
    from flashdraft.train.checkpoint import load_drafter

    out = tmp_path / "p"
    command = [sys.executable, str(ROOT / "experiments" / "peer_recipe.py"), "--smoke"]
    command += ["--target", str(tiny_qwen3_dir), "--output", str(out)]
    first = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    result = json.loads(first.stdout.strip().splitlines()[-1])
    assert result["steps"] == 8 and result["peer_version"] == "0.9.0"
    history = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [r["step"] for r in history] == list(range(1, 9))
    assert result["loss_last"] < result["loss_first"]
    assert result["label_agreement"] == 1.0  # fp32 on the CPU: no ties to excuse
    for folder in ("speculators", "export"):
        drafter = load_drafter(str(out / folder))
        assert json.loads(json.dumps(dataclasses.asdict(drafter.config))) == result["drafter"]
    assert result["export"]["same_weights"] is True
    assert result["eval"] and all(e["tau"] >= 1.0 for e in result["eval"].values())
    assert any("D-PACE" in line or "dpace" in line for line in result["caveats"])
    assert result["speculators_settings"]["optimizer"] == "muon"

    again = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "trained already" in again.stdout + again.stderr
    assert json.loads(again.stdout.strip().splitlines()[-1])["eval"] == result["eval"]

    # Stopped by --deadline at its first log record (start-up alone outlasts the deadline
    # less the time kept for saving), then resumed: the same steps, losses and eval as the
    # run in one go (the rows, weights, optimizer states and generators all put back).
    split = tmp_path / "q"
    stopped = [*command[:-1], str(split), "--deadline", "21"]
    cut = subprocess.run(stopped, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert cut.returncode == 0, cut.stdout[-3000:] + cut.stderr[-3000:]
    assert json.loads(cut.stdout.strip().splitlines()[-1])["complete"] is False
    assert (split / "resume" / "progress.json").exists() and not (split / "train.json").exists()
    # the steps measured so far are where the results are collected, should no call follow
    so_far = [json.loads(x) for x in (split / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in so_far] == [1] and so_far[0]["elapsed_s"] > 0
    # the rest saves every 3 steps on the way (`--save-every`): the same run all the same
    again_split = [*command[:-1], str(split), "--save-every", "3"]
    rest = subprocess.run(again_split, capture_output=True, text=True, cwd=ROOT)
    assert rest.returncode == 0, rest.stdout[-3000:] + rest.stderr[-3000:]
    resumed = json.loads(rest.stdout.strip().splitlines()[-1])
    assert resumed["resumed_after"] == [1] and not (split / "resume").exists()

    def steps(folder: Path) -> list[dict]:
        lines = (folder / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(x).items() if k != "elapsed_s"} for x in lines]

    assert steps(split) == steps(out)
    assert [e["tau"] for e in resumed["eval"].values()] == [
        e["tau"] for e in result["eval"].values()
    ]

    # SIGTERM (s49: a peer killed 370 steps after its last save) saves the state at the next
    # log record, as --deadline does, and the same command goes on to the same run. Sent
    # at the first record: 7 steps before the training (and its handler) ends.
    killed, log = tmp_path / "k", tmp_path / "k.txt"
    with log.open("w") as sink:
        process = subprocess.Popen(
            [*command[:-1], str(killed)], stdout=sink, stderr=subprocess.STDOUT, cwd=ROOT
        )
    try:
        while "step 1/8:" not in log.read_text():
            assert process.poll() is None, log.read_text()[-3000:]
            time.sleep(0.02)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=300) == 0, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert "stopped for SIGTERM, state in" in log.read_text()
    assert (killed / "resume" / "progress.json").exists()
    rest = subprocess.run(
        [*command[:-1], str(killed)], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert rest.returncode == 0, rest.stdout[-3000:] + rest.stderr[-3000:]
    assert steps(killed) == steps(out)


def test_the_peer_step_settings_are_speculators_defaults_as_flashdraft_words(
    bench: dict[str, ModuleType],
) -> None:
    """`flashdraft_overrides` (speculators' step as flashdraft settings, which
    test_peer_step.py holds to speculators itself) for the 2-epoch runs' 4,626 steps: the
    words the device runs of the peer's settings were given; a setting it cannot map is a
    one-line error naming it."""
    speculators_oracle()
    peer = bench["peer_config"]
    flat = peer.speculators_settings()
    words = peer.flashdraft_overrides(flat, 4626)
    expected = [
        "loss.weighting=dpace",
        "loss.dpace_alpha=0.5",
        "loss.labels=target",
        "optim.optimizer=muon",
        "optim.lr=0.001",
        "optim.muon_momentum=0.95",
        "optim.muon_weight_decay=0.1",
        "optim.betas=[0.9,0.999]",
        "optim.eps=1e-08",
        "optim.weight_decay=0.01",
        "optim.schedule=linear",
        "optim.min_lr_ratio=0.0",
        "optim.warmup_steps=46",
        "optim.grad_clip=1.0",
    ]
    # the preset mixes half the argmax into soft labels; the peer's hard labels reset it
    assert "loss.argmax_mix=0" in words
    assert [w for w in words if w != "loss.argmax_mix=0"] == expected
    with pytest.raises(ValueError, match="loss_fn = 'kl_div'"):
        peer.flashdraft_overrides({**flat, "loss_fn": "kl_div"}, 4626)
    with pytest.raises(ValueError, match="one lr"):
        peer.flashdraft_overrides({**flat, "muon_lr": 2e-3}, 4626)
