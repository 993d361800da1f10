"""Records -> jobs (one per turn to regenerate, stable ids) -> batches and their seeds."""

from __future__ import annotations

import json

import pytest

from flashdraft.data.formats import RecordError
from flashdraft.data.jobs import batch_seed, jobs_from_record, plan_batches, record_key, shard_of


def test_messages_regenerate_the_last_or_every_assistant_turn() -> None:
    record = {
        "id": "chat-1",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Bye!"},
        ],
    }
    (last,) = jobs_from_record(record, "f:1", "last")
    assert last.id == "chat-1#4"
    assert [m.role for m in last.prompt] == ["system", "user", "assistant", "user"]
    every = jobs_from_record(record, "f:1", "all")
    assert [j.id for j in every] == ["chat-1#2", "chat-1#4"]
    assert [m.content for m in every[0].prompt] == ["Be brief.", "Hi"]


def test_a_conversation_ending_in_a_user_turn_asks_for_the_next_turn() -> None:
    record = {"messages": [{"role": "user", "content": "Hi"}]}
    (job,) = jobs_from_record(record, "f:1", "last")
    assert job.id == f"{record_key(record)}#1"
    assert [m.content for m in job.prompt] == ["Hi"]
    sharegpt = {
        "conversations": [
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello"},
            {"from": "human", "value": "Bye"},
        ]
    }
    assert [j.id.split("#")[1] for j in jobs_from_record(sharegpt, "f:2", "all")] == ["1", "3"]


def test_prompt_records_with_or_without_completion() -> None:
    (bare,) = jobs_from_record({"prompt": "Hi", "system": "Be brief."}, "f:1", "last")
    assert [(m.role, m.content) for m in bare.prompt] == [("system", "Be brief."), ("user", "Hi")]
    (answered,) = jobs_from_record({"id": 7, "prompt": "Hi", "completion": "Hello"}, "f:2", "all")
    assert answered.id == "7#1"
    assert [m.content for m in answered.prompt] == ["Hi"]


def test_bad_records_raise_with_the_reason() -> None:
    with pytest.raises(RecordError, match="start with a user turn"):
        jobs_from_record({"messages": [{"role": "assistant", "content": "x"}]}, "f:1", "last")
    with pytest.raises(RecordError, match="none of"):
        jobs_from_record({"text": "x"}, "f:1", "last")
    with pytest.raises(RecordError, match="not an object"):
        jobs_from_record([1], "f:1", "last")


def test_ids_are_stable_and_content_derived_without_an_id() -> None:
    a = {"prompt": "Hi"}
    assert record_key(a) == record_key({"prompt": "Hi"}) == record_key(json.loads(json.dumps(a)))
    assert record_key(a) != record_key({"prompt": "Hi!"})
    assert record_key({"id": "x", "prompt": "Hi"}) == "x"
    assert len(record_key(a)) == 16


def test_batches_sort_by_length_and_respect_size_and_token_budget() -> None:
    lengths = [5, 50, 7, 48, 6, 30]
    batches = plan_batches(lengths, batch_size=2, max_batch_tokens=None, max_new_tokens=10)
    assert batches == [[1, 3], [5, 2], [4, 0]]
    budget = plan_batches(lengths, batch_size=8, max_batch_tokens=130, max_new_tokens=10)
    assert sorted(i for b in budget for i in b) == list(range(6))
    for batch in budget:
        assert len(batch) == 1 or len(batch) * (max(lengths[i] for i in batch) + 10) <= 130
    assert budget[0] == [1, 3]  # 2 × (50 + 10) = 120 fits, a third row would not


def test_batch_seed_depends_on_seed_and_batch_only() -> None:
    assert batch_seed(0, ["a", "b"]) == batch_seed(0, iter(["a", "b"]))
    assert len({batch_seed(0, ["a", "b"]), batch_seed(1, ["a", "b"]), batch_seed(0, ["b"])}) == 3


def test_shards_split_jobs_by_id() -> None:
    ids = [f"record-{i}#1" for i in range(200)]
    counts = [sum(shard_of(i, 4) == k for i in ids) for k in range(4)]
    assert sum(counts) == 200 and min(counts) > 20  # every shard gets a fair part
    assert shard_of("record-7#1", 4) == shard_of("record-7#1", 4)
