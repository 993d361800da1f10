"""`flashdraft prepare` end to end: inputs, rejects, determinism, resume, refusals."""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path
from typing import Any

import fsspec
import pytest
import zstandard

from flashdraft import cli
from flashdraft.data.audit import Thresholds
from flashdraft.data.dataset import dataset_identity, open_dataset
from flashdraft.data.prepare import ShardProcessor, prepare
from flashdraft.data.prepare_config import PrepareConfig
from flashdraft.data.template import TemplateOptions


def chat(i: int) -> dict[str, Any]:
    return {
        "messages": [
            {"role": "user", "content": f"Tell me about topic {i}."},
            {
                "role": "assistant",
                "content": f"Topic {i} matters because of fact {i * 3}, seen in case {i % 7}.",
            },
        ]
    }


def lines(records: list[Any]) -> bytes:
    return b"".join(
        (r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in records
    )


BAD = [
    b'{"messages": [',  # malformed JSON
    b'{"prompt": "caf\xe9", "completion": "x"}',  # invalid UTF-8 (latin-1 bytes)
    {"messages": [{"role": "robot", "content": "beep"}]},
    {"messages": [{"content": "no role"}]},
    {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]},
]


def config(inputs: list[str], tokenizer: Path, output: Path, **kw: Any) -> PrepareConfig:
    kw.setdefault("workers", 1)
    kw.setdefault("progress", False)
    kw.setdefault("preview", 0)
    return PrepareConfig(inputs=inputs, tokenizer=str(tokenizer), output=str(output), **kw)


def run(cfg: PrepareConfig) -> Any:
    return prepare(cfg)


def test_mixed_inputs_end_to_end(tmp_path: Path, smollm2_dir: Path) -> None:
    data = tmp_path / "in"
    (data / "sub").mkdir(parents=True)
    (data / "a.jsonl").write_bytes(lines([chat(i) for i in range(20)] + BAD))
    sharegpt = [
        {
            "conversations": [
                {"from": "human", "value": f"hi {i}"},
                {"from": "gpt", "value": f"hello there, friend number {i}!"},
            ]
        }
        for i in range(10)
    ]
    (data / "sub" / "b.jsonl.gz").write_bytes(gzip.compress(lines(sharegpt)))
    completions = [
        {"prompt": f"Count to {i}.", "response": " ".join(str(k) for k in range(1, i + 12))}
        for i in range(10)
    ]
    (data / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines(completions)))
    result = run(config([str(data)], smollm2_dir, tmp_path / "out", max_reject_rate=0.5))
    manifest = result.manifest
    assert manifest["status"] == "complete", manifest["problems"]
    assert manifest["counts"] == {
        "records": 46,
        "samples": 40,
        "rejected": 6,
        "truncated": 0,
        "tokens": manifest["counts"]["tokens"],
        "loss_tokens": manifest["counts"]["loss_tokens"],
    }
    # Inputs in sorted order, with the hash of the bytes as stored (compressed).
    assert [Path(i["url"]).name for i in manifest["inputs"]] == [
        "a.jsonl",
        "c.jsonl.zst",
        "b.jsonl.gz",
    ]
    for entry in manifest["inputs"]:
        assert entry["sha256"] == hashlib.sha256(Path(entry["url"]).read_bytes()).hexdigest()
    rejects = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert [r["source"] for r in rejects] == [f"{data / 'a.jsonl'}:{n}" for n in range(21, 27)]
    reasons = " | ".join(r["reason"] for r in rejects)
    for reason in (
        "malformed JSON",
        "invalid UTF-8",
        "unknown or missing role 'robot'",
        "missing role None",
        "two user turns",
        "empty",
    ):
        assert reason in reasons
    dataset = open_dataset(str(tmp_path / "out"))
    assert len(dataset) == 40 and dataset.source(0) == f"{data / 'a.jsonl'}:1"
    assert int(dataset.num_loss_tokens.sum()) == manifest["counts"]["loss_tokens"]
    assert dataset_identity(str(tmp_path / "out")) == manifest["content_sha256"]
    datasets = pytest.importorskip("datasets")
    assert len(datasets.load_from_disk(str(tmp_path / "out"))) == 40


def test_output_independent_of_workers_and_resume(tmp_path: Path, smollm2_dir: Path) -> None:
    source = tmp_path / "chats.jsonl"
    source.write_bytes(lines([chat(i) for i in range(60)] + BAD[:1]))
    one = run(
        config([str(source)], smollm2_dir, tmp_path / "one", shard_size=16, max_reject_rate=0.1)
    )
    two = run(
        config(
            [str(source)],
            smollm2_dir,
            tmp_path / "two",
            shard_size=16,
            max_reject_rate=0.1,
            workers=2,
        )
    )
    files = sorted(p.name for p in (tmp_path / "one").iterdir() if p.is_file())
    assert files == [
        "data-00000-of-00004.arrow",
        "data-00001-of-00004.arrow",
        "data-00002-of-00004.arrow",
        "data-00003-of-00004.arrow",
        "dataset_info.json",
        "manifest.json",
        "rejects.jsonl",
        "state.json",
    ]
    for name in files:
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    assert one.manifest == two.manifest

    # An interrupted shard has no marker: a re-run redoes it alone and ends identical.
    before = {p.name: p.read_bytes() for p in (tmp_path / "one").iterdir() if p.is_file()}
    (tmp_path / "one" / ".work" / "shard-00002.json").unlink()
    again = run(
        config([str(source)], smollm2_dir, tmp_path / "one", shard_size=16, max_reject_rate=0.1)
    )
    assert again.reused_shards == 3
    assert before == {p.name: p.read_bytes() for p in (tmp_path / "one").iterdir() if p.is_file()}
    # Grown input: refused over a finished dataset; with --overwrite the finished shards are
    # reused, the last one is redone, names follow.
    source.write_bytes(
        lines([chat(i) for i in range(60)] + BAD[:1] + [chat(100 + i) for i in range(20)])
    )
    grown_config = config(
        [str(source)], smollm2_dir, tmp_path / "one", shard_size=16, max_reject_rate=0.1
    )
    with pytest.raises(FileExistsError, match=r"other inputs \(.*chats\.jsonl has"):
        run(grown_config)
    grown_config.overwrite = True
    grown = run(grown_config)
    assert grown.reused_shards == 3
    assert len(open_dataset(str(tmp_path / "one"))) == 80
    assert grown.manifest["data_files"][-1] == "data-00005-of-00006.arrow"


def test_other_settings_are_refused_unless_overwrite(tmp_path: Path, smollm2_dir: Path) -> None:
    source = tmp_path / "chats.jsonl"
    source.write_bytes(lines([chat(i) for i in range(8)]))
    run(config([str(source)], smollm2_dir, tmp_path / "out"))
    last = TemplateOptions(turns="last")
    with pytest.raises(FileExistsError, match="other settings"):
        run(config([str(source)], smollm2_dir, tmp_path / "out", template=last))
    result = run(
        config([str(source)], smollm2_dir, tmp_path / "out", template=last, overwrite=True)
    )
    assert result.manifest["options"]["turns"] == "last"
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a flashdraft dataset"):
        run(config([str(source)], smollm2_dir, tmp_path / "foreign", overwrite=True))


def test_too_many_rejects_fail_the_run(
    tmp_path: Path, smollm2_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "mostly-bad.jsonl"
    source.write_bytes(lines([chat(i) for i in range(20)] + BAD))
    out = tmp_path / "out"
    argv = [
        "prepare",
        str(source),
        "--tokenizer",
        str(smollm2_dir),
        "--output",
        str(out),
        "--workers",
        "1",
        "--preview",
        "0",
    ]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert "6 of 26 records (23.1%) were rejected, more than --max-reject-rate 0.01" in err
    assert "rejects.jsonl" in err
    with pytest.raises(ValueError, match="must not be trained on"):
        open_dataset(str(out))
    # Raising the threshold reuses the finished shards and completes.
    assert cli.main([*argv, "--max-reject-rate", "0.3"]) == 0
    assert len(open_dataset(str(out))) == 20


def test_degenerate_data_is_refused_unless_allowed(
    tmp_path: Path, qwen3_tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 87% of the responses are an empty think block and "OK.": the incident from the issue.
    records = [chat(i) for i in range(13)] + [
        {
            "messages": [
                {"role": "user", "content": f"Ping {i}"},
                {"role": "assistant", "content": "<think>\n\n</think>\n\nOK."},
            ]
        }
        for i in range(87)
    ]
    source = tmp_path / "ok.jsonl"
    source.write_bytes(lines(records))
    argv = [
        "prepare",
        str(source),
        "--tokenizer",
        str(qwen3_tokenizer_dir),
        "--output",
        str(tmp_path / "out"),
        "--workers",
        "1",
        "--preview",
        "0",
    ]
    assert cli.main(argv) == 1
    captured = capsys.readouterr()
    assert (
        "86 of 100 samples (86.0%) train on a response that another sample also trains on"
        in captured.err
    )
    assert "87 x 'OK.<|im_end|>'" in captured.err  # the empty think block is not trained
    assert "--allow-degenerate" in captured.err
    assert cli.main([*argv, "--allow-degenerate"]) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["status"] == "complete" and len(manifest["warnings"]) == 2


def test_overlong_samples_are_dropped_or_truncated(tmp_path: Path, smollm2_dir: Path) -> None:
    long_answer = "word " * 200
    records = [chat(i) for i in range(30)] + [
        {
            "messages": [
                {"role": "user", "content": "long?"},
                {"role": "assistant", "content": long_answer},
            ]
        }
    ]
    source = tmp_path / "chats.jsonl"
    source.write_bytes(lines(records))
    dropped = run(
        config([str(source)], smollm2_dir, tmp_path / "drop", max_length=100, max_reject_rate=0.05)
    )
    assert (
        dropped.manifest["counts"]["rejected"] == 1 and dropped.manifest["counts"]["samples"] == 30
    )
    reject = json.loads((tmp_path / "drop" / "rejects.jsonl").read_text())
    assert reject["source"].endswith(":31") and "over --max-length 100" in reject["reason"]
    truncated = run(
        config(
            [str(source)],
            smollm2_dir,
            tmp_path / "cut",
            max_length=100,
            overlong="truncate",
            thresholds=_lenient(),
        )
    )
    assert truncated.manifest["counts"]["truncated"] == 1
    dataset = open_dataset(str(tmp_path / "cut"))
    assert dataset.num_tokens.max() == 100 and len(dataset) == 31


def test_records_over_the_size_limits_are_rejected_and_counted(
    tmp_path: Path, smollm2_dir: Path, smollm2_tokenizer: Any
) -> None:
    """Bytes before parsing (a 50 MB record once took 8.5 GB to tokenize and then was 99.98%
    of the dataset's tokens), tokens after tokenizing, whatever --overlong does."""
    many_tokens = {"prompt": "Count.", "completion": " ".join(str(k % 10) for k in range(700))}
    huge = b'{"messages": [' + b"x" * 20_000  # over the bytes limit, and broken JSON too
    source = tmp_path / "chats.jsonl"
    source.write_bytes(lines([chat(i) for i in range(20)] + [many_tokens, huge]))
    result = run(
        config(
            [str(source)],
            smollm2_dir,
            tmp_path / "out",
            max_record_bytes=10_000,
            max_record_tokens=500,
            max_length=100,
            overlong="truncate",  # would have cut the long sample: it is rejected first
            max_reject_rate=0.1,
        )
    )
    counts = result.manifest["counts"]
    assert counts["samples"] == 20 and counts["rejected"] == 2 and counts["truncated"] == 0
    rejects = [json.loads(x) for x in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    reasons = {r["source"].rsplit(":", 1)[1]: r["reason"] for r in rejects}
    assert sorted(reasons) == ["21", "22"]
    assert reasons["21"].endswith("tokens, over --max-record-tokens 500")
    assert reasons["22"] == f"{len(huge)} bytes, over --max-record-bytes 10000"
    assert result.manifest["rejected_by_reason"] == {
        "N tokens, over --max-record-tokens N": 1,
        "N bytes, over --max-record-bytes N": 1,
    }
    assert result.manifest["options"]["max_record_bytes"] == 10_000
    # The defaults: a 5 MB record is refused before it is parsed or tokenized.
    defaults = PrepareConfig(inputs=["x"], tokenizer=str(smollm2_dir), output="o")
    assert defaults.max_record_bytes == 4 << 20 and defaults.max_record_tokens == 131_072
    record = json.dumps({"prompt": "Say it.", "completion": "word " * 1_000_000}).encode()
    shard = ShardProcessor(defaults, smollm2_tokenizer)(0, [("big.jsonl:1", record)])
    assert shard.rejects == [
        ("big.jsonl:1", f"{len(record)} bytes, over --max-record-bytes 4194304")
    ]


def _lenient() -> Thresholds:
    return Thresholds(max_truncated_share=0.5)


def test_rewritten_turns_get_their_own_samples(tmp_path: Path, qwen3_tokenizer_dir: Path) -> None:
    record = {
        "messages": [
            {"role": "user", "content": "Hi"},
            {
                "role": "assistant",
                "content": "Hello, how can I help you today?",
                "reasoning_content": "A greeting.",
            },
            {"role": "user", "content": "What is 2+2?"},
            {
                "role": "assistant",
                "content": "2+2 is 4, a basic sum.",
                "reasoning_content": "Add the numbers.",
            },
        ]
    }
    source = tmp_path / "think.jsonl"
    source.write_bytes(lines([record, chat(1)]))
    result = run(
        config([str(source)], qwen3_tokenizer_dir, tmp_path / "out", thresholds=_lenient())
    )
    dataset = open_dataset(str(tmp_path / "out"))
    assert [dataset.source(i) for i in range(len(dataset))] == [
        f"{source}:1#1",
        f"{source}:1",
        f"{source}:2",
    ]
    assert result.manifest["counts"]["records"] == 2


def test_fsspec_urls_for_inputs_and_output(tmp_path: Path, smollm2_dir: Path) -> None:
    with fsspec.open("memory://flashdraft-prepare/in/chats.jsonl", "wb") as f:
        f.write(lines([chat(i) for i in range(12)]))
    out = "memory://flashdraft-prepare/out"
    cfg = PrepareConfig(
        inputs=["memory://flashdraft-prepare/in/*.jsonl"],
        tokenizer=str(smollm2_dir),
        output=out,
        workers=1,
        shard_size=5,
        progress=False,
        preview=0,
    )
    result = run(cfg)
    assert result.manifest["inputs"][0]["url"] == "memory:///flashdraft-prepare/in/chats.jsonl"
    assert result.manifest["counts"]["samples"] == 12
    assert open_dataset(out).source(11) == "memory:///flashdraft-prepare/in/chats.jsonl:12"
    assert run(cfg).reused_shards == 3
    with pytest.raises(FileNotFoundError, match="matched no data files"):
        run(config(["memory://flashdraft-prepare/none/*.jsonl"], smollm2_dir, tmp_path / "out2"))


def test_changed_inputs_are_refused_over_a_finished_dataset(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    source = tmp_path / "chats.jsonl"
    source.write_bytes(lines([chat(i) for i in range(8)]))
    run(config([str(source)], smollm2_dir, tmp_path / "out"))
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir() if p.is_file()}
    source.write_bytes(lines([chat(i) for i in range(7)] + [chat(8)]))  # same size, changed
    with pytest.raises(FileExistsError, match="its sha256 differs"):
        run(config([str(source)], smollm2_dir, tmp_path / "out"))
    assert before == {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir() if p.is_file()}
    other = tmp_path / "other.jsonl"
    other.write_bytes(lines([chat(i) for i in range(8)]))
    with pytest.raises(FileExistsError, match=r"no longer given: .*chats\.jsonl; new: "):
        run(config([str(other)], smollm2_dir, tmp_path / "out"))
    replaced = run(config([str(source)], smollm2_dir, tmp_path / "out", overwrite=True))
    assert (
        replaced.manifest["inputs"][0]["sha256"] == hashlib.sha256(source.read_bytes()).hexdigest()
    )


def test_a_byte_order_mark_and_empty_inputs(tmp_path: Path, smollm2_dir: Path) -> None:
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + lines([chat(i) for i in range(4)]))
    result = run(config([str(bom)], smollm2_dir, tmp_path / "out"))
    assert result.manifest["counts"]["samples"] == 4 and result.manifest["counts"]["rejected"] == 0
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n  \n")  # only blank lines
    with pytest.raises(ValueError, match=f"no records in {empty}: the file is empty"):
        run(config([str(empty)], smollm2_dir, tmp_path / "nothing"))
    assert not (tmp_path / "nothing").exists()  # no half state left behind
    both = run(config([str(empty), str(bom)], smollm2_dir, tmp_path / "both"))
    assert both.manifest["counts"]["samples"] == 4  # an empty file among others: a warning


def test_duplicate_ids_are_rejected_in_input_order_across_shards_and_on_resume(
    tmp_path: Path, smollm2_dir: Path
) -> None:
    records = [{**chat(i), "id": f"r{i % 9}"} for i in range(12)]  # r0, r1, r2 twice
    records[4].pop("id")  # a record without an id is never a duplicate
    records.append({**chat(40), "id": 2})  # an integer id, its own
    source = tmp_path / "ids.jsonl"
    source.write_bytes(lines(records))
    results = {}
    for name, shard_size in (("one", 100), ("sharded", 4)):  # within a shard and across
        results[name] = run(
            config(
                [str(source)],
                smollm2_dir,
                tmp_path / name,
                shard_size=shard_size,
                max_reject_rate=0.5,
            )
        )
        rejects = (tmp_path / name / "rejects.jsonl").read_text().splitlines()
        assert [json.loads(r) for r in rejects] == [
            {
                "source": f"{source}:{10 + k}",
                "reason": f"duplicate id 'r{k}' (ids must be unique; first at {source}:{1 + k})",
            }
            for k in range(3)
        ]
        counts = results[name].manifest["counts"]
        assert (counts["records"], counts["samples"], counts["rejected"]) == (13, 10, 3)
    one, sharded = open_dataset(str(tmp_path / "one")), open_dataset(str(tmp_path / "sharded"))
    assert [one.source(i) for i in range(10)] == [sharded.source(i) for i in range(10)]
    assert results["one"].manifest["counts"] == results["sharded"].manifest["counts"]
    # Resumed after a shard was lost, the duplicates are decided again the same way.
    before = {p.name: p.read_bytes() for p in (tmp_path / "sharded").iterdir() if p.is_file()}
    (tmp_path / "sharded" / ".work" / "shard-00000.json").unlink()
    again = run(
        config([str(source)], smollm2_dir, tmp_path / "sharded", shard_size=4, max_reject_rate=0.5)
    )
    assert again.reused_shards == 3
    assert before == {
        p.name: p.read_bytes() for p in (tmp_path / "sharded").iterdir() if p.is_file()
    }


def test_the_manifest_is_never_left_checking(
    tmp_path: Path, smollm2_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import flashdraft.data.prepare as prepare_module

    def crash(*args: Any, **kwargs: Any) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(prepare_module, "audit_dataset", crash)
    source = tmp_path / "chats.jsonl"
    source.write_bytes(lines([chat(i) for i in range(4)]))
    with pytest.raises(KeyboardInterrupt):
        run(config([str(source)], smollm2_dir, tmp_path / "out"))
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["status"] == "failed"
    assert manifest["problems"] == ["the checks did not finish (KeyboardInterrupt: )"]
    monkeypatch.undo()
    assert run(config([str(source)], smollm2_dir, tmp_path / "out")).ok  # and it finishes


def test_loops_are_untrained_past_their_first_tokens(tmp_path: Path, smollm2_dir: Path) -> None:
    """A small target's answer stuck on "no no no ...": with --loops untrain only the loop's
    first --loop-keep tokens stay trained; the tokens stay in the sample, the manifest counts
    the untrained ones and records the setting, and a resume with other loop settings is
    refused like any other data setting."""
    looping = {
        "messages": [
            {"role": "user", "content": "Are you sure?"},
            {"role": "assistant", "content": "I think so, but" + " no" * 150},
        ]
    }
    source = tmp_path / "chats.jsonl"
    source.write_bytes(lines([chat(i) for i in range(20)] + [looping]))
    kept = run(config([str(source)], smollm2_dir, tmp_path / "keep"))
    cut = run(config([str(source)], smollm2_dir, tmp_path / "cut", loops="untrain", loop_keep=8))
    assert "loop_untrained" not in kept.manifest["counts"]  # the default: as before
    # the audit (docs/design.md §8 trap 8's checks) reads the masks as written: the loop before, not after
    assert "loops            1 samples" in kept.report and "\nloops " not in cut.report
    counts, before = cut.manifest["counts"], kept.manifest["counts"]
    assert counts["tokens"] == before["tokens"] and counts["samples"] == before["samples"]
    assert 130 <= counts["loop_untrained"] == before["loss_tokens"] - counts["loss_tokens"]
    assert cut.manifest["options"]["loops"] == {"mode": "untrain", "keep": 8, "min": 64}
    last = len(open_dataset(str(tmp_path / "cut"))) - 1
    ids, mask = open_dataset(str(tmp_path / "cut")).sample(last)
    full_ids, full_mask = open_dataset(str(tmp_path / "keep")).sample(last)
    assert ids.tolist() == full_ids.tolist()  # the context is unchanged
    dropped = (full_mask == 1) & (mask == 0)  # the loop's tail, one " no" token over and over
    assert len(set(ids[dropped].tolist())) == 1 and dropped.sum() == counts["loop_untrained"]
    assert mask[-1] == full_mask[-1] == 1  # the end of turn after the loop: still trained
    with pytest.raises(FileExistsError, match="loops"):
        run(config([str(source)], smollm2_dir, tmp_path / "cut", loops="untrain", loop_keep=4))
