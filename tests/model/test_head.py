import pytest
import torch
from torch import nn

from flashdraft.model.config import DrafterConfig
from flashdraft.model.head import TargetHead


def test_chunked_argmax_at_equals_argmax_of_full_logits() -> None:
    gen = torch.Generator().manual_seed(0)
    embedding = nn.Embedding(50, 8)
    head = TargetHead(embedding=embedding, weight=torch.randn(50, 8, generator=gen), softcap=3.0)
    hidden = torch.randn(2, 12, 8, generator=gen)
    positions = torch.randint(0, 12, (2, 4, 3), generator=gen)
    # Chunks of 5 rows over 12 picked rows per call: uneven last chunk on purpose.
    picked = head.argmax_at(hidden, positions, chunk_rows=5)
    rows = hidden.gather(1, positions.reshape(2, -1, 1).expand(-1, -1, 8))
    assert picked.shape == positions.shape
    assert torch.equal(picked, head.logits(rows).argmax(-1).view(positions.shape))


def _tiny(config_cls: type, **extra: object) -> nn.Module:
    from transformers import AutoModelForCausalLM

    config = config_cls(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        **extra,
    )
    return AutoModelForCausalLM.from_config(config)


def _configs() -> list[tuple[type, dict]]:
    from transformers import CohereConfig, Gemma2Config, Gemma3TextConfig, LlamaConfig

    return [
        (LlamaConfig, {}),
        (Gemma2Config, {"final_logit_softcapping": 30.0}),
        (Gemma3TextConfig, {"final_logit_softcapping": 30.0}),
        (CohereConfig, {"logit_scale": 0.0625}),
    ]


@pytest.mark.parametrize("index", range(4))
def test_drafter_config_records_what_the_real_head_applies(index: int) -> None:
    """The scaling `DrafterConfig.from_target_config` derives from a target's config (and the
    export writes for the engines) is what transformers' modules really apply."""
    config_cls, extra = _configs()[index]
    model = _tiny(config_cls, **extra)
    head = TargetHead.from_model(model)
    config = DrafterConfig.from_target_config(model.config, mask_token_id=0, num_layers=1)
    head.check_drafter(config)
    ids = torch.tensor([[3, 9]])
    raw = model.get_input_embeddings().weight[ids]
    torch.testing.assert_close(head.embed(ids), raw * config.input_embedding_scale)
    wrong = DrafterConfig.from_dict({**config.to_dict(), "input_embedding_scale": 2.0})
    with pytest.raises(ValueError, match=r"input_embedding_scale 2\.0"):
        head.check_drafter(wrong)


@pytest.mark.parametrize("top_k", [1, 6, 50])
def test_chunked_top_k_labels_are_the_renormalised_top_of_the_full_softmax(top_k) -> None:
    """Soft labels: the k most likely tokens of the full logits and their probabilities
    renormalised over those k (k = V: the full distribution); the argmax is unchanged."""
    gen = torch.Generator().manual_seed(1)
    head = TargetHead(
        embedding=nn.Embedding(50, 8), weight=torch.randn(50, 8, generator=gen), softcap=3.0
    )
    head.logit_scale = 1.7
    hidden = torch.randn(2, 12, 8, generator=gen)
    positions = torch.randint(0, 12, (2, 4, 3), generator=gen)
    argmax, ids, probs = head.labels_at(hidden, positions, chunk_rows=5, top_k=top_k)
    assert ids is not None and probs is not None
    assert torch.equal(argmax, head.argmax_at(hidden, positions, chunk_rows=5))
    assert ids.shape == probs.shape == (*positions.shape, top_k) and probs.dtype == torch.float32
    rows = hidden.gather(1, positions.reshape(2, -1, 1).expand(-1, -1, 8))
    full = head.logits(rows).softmax(-1).view(*positions.shape, 50)
    top = full.topk(top_k, dim=-1)
    assert torch.equal(ids, top.indices)
    torch.testing.assert_close(probs, top.values / top.values.sum(-1, keepdim=True))
    torch.testing.assert_close(probs.sum(-1), torch.ones(positions.shape))
    if top_k == 50:
        torch.testing.assert_close(full.gather(-1, ids), probs)
    assert head.labels_at(hidden, positions, chunk_rows=5)[1:] == (None, None)


@pytest.mark.parametrize("top_k", [0, 6])
def test_compiled_label_chunks_give_the_eager_labels(monkeypatch, top_k) -> None:
    """CUDA's path (`compiled=True`, here inductor on the CPU): the rows padded to whole
    chunks, one compiled chunk shape for every call, and the labels of the eager chunks
    exactly, in bf16 with a scaled and capped head (rounded as eager rounds)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    from flashdraft.model import head as head_module

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(
        head_module.label_chunk,
        backend=counter,
        dynamic=False,
    )
    shapes = []

    def chunk(z, *args):
        shapes.append(tuple(z.shape))
        with torch._inductor.config.patch(head_module.LABEL_CHUNK_OPTIONS):
            return compiled(z, *args)

    monkeypatch.setattr(head_module, "_LABEL_CHUNK", chunk)
    gen = torch.Generator().manual_seed(2)
    weight = torch.randn(50, 8, generator=gen).bfloat16()
    head = TargetHead(embedding=nn.Embedding(50, 8), weight=weight, softcap=3.0)
    head.logit_scale = 1.7
    hidden = torch.randn(1, 40, 8, generator=gen).bfloat16()
    for n in (7, 13, 16, 5, 20):  # label positions per call, as a label plan's count varies
        positions = torch.randint(0, 40, (1, n), generator=gen)
        got = head.labels_at(hidden, positions, chunk_rows=8, top_k=top_k, compiled=True)
        want = head.labels_at(hidden, positions, chunk_rows=8, top_k=top_k, compiled=False)
        assert got[0].shape == (1, n) and torch.equal(got[0], want[0])
        if top_k:
            assert torch.equal(got[1], want[1])
            torch.testing.assert_close(got[2], want[2])
        else:
            assert got[1:] == (None, None)
    assert set(shapes) == {(8, 50)} and counter.frame_count == 1


@pytest.mark.gpu
@pytest.mark.parametrize("top_k", [0, 32])
def test_on_cuda_the_compiled_label_chunks_give_the_eager_labels(top_k) -> None:
    """The real `_LABEL_CHUNK` on CUDA at SmolLM2's vocabulary, bf16: the eager labels."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    weight = torch.randn(49152, 576, generator=gen, device="cuda").bfloat16()
    head = TargetHead(embedding=nn.Embedding(8, 576), weight=weight)
    hidden = torch.randn(1, 5000, 576, generator=gen, device="cuda").bfloat16()
    for n in (4074, 3001):
        positions = torch.randperm(5000, generator=gen, device="cuda")[:n][None]
        got = head.labels_at(hidden, positions, chunk_rows=2048, top_k=top_k)
        want = head.labels_at(hidden, positions, chunk_rows=2048, top_k=top_k, compiled=False)
        assert torch.equal(got[0], want[0])
        if top_k:
            assert torch.equal(got[1], want[1])
            torch.testing.assert_close(got[2], want[2])
