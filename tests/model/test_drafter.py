import pytest
import torch
from helpers import tiny_config, tiny_drafter, tiny_head

from flashdraft.model.attention import BlockLayout
from flashdraft.model.drafter import DraftCache
from flashdraft.train.blocks import block_inputs

SERVING_NAMES = {
    "fc.weight",
    "hidden_norm.weight",
    "norm.weight",
    *(
        f"layers.{i}.{name}.weight"
        for i in range(2)
        for name in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "self_attn.q_norm",
            "self_attn.k_norm",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
            "input_layernorm",
            "post_attention_layernorm",
        )
    ),
}


def test_parameter_names_are_the_serving_names_and_exclude_embedding_and_head() -> None:
    drafter = tiny_drafter()
    assert set(drafter.state_dict()) == SERVING_NAMES
    assert drafter.fc.weight.shape == (32, 2 * 32)  # K * H -> H


def _row(seed: int, length: int, taps: int = 2, hidden: int = 32):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, length, taps * hidden, generator=gen),
        torch.randint(0, 90, (1, length), generator=gen),
    )


def _train_path(
    drafter, head, target_hidden, ids, positions, docs, anchors, valid=None, residual=None
):
    config = drafter.config
    valid = torch.ones_like(anchors, dtype=torch.bool) if valid is None else valid
    block_ids, block_pos = block_inputs(
        ids, positions, anchors, config.block_size, config.mask_token_id
    )
    masks = drafter.build_masks(BlockLayout(anchors, valid, docs, config.block_size), "sdpa")
    embeds = head.embed(block_ids).to(target_hidden.dtype)  # as train.step.draft_hidden
    out = drafter(target_hidden, embeds, positions, block_pos, masks, residual)
    return out.view(1, anchors.shape[1], config.block_size, -1)


@pytest.mark.parametrize("sliding", [False, True])
def test_decode_path_equals_training_path(sliding: bool) -> None:
    overrides = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3}
    config = tiny_config(**(overrides if sliding else {}))
    drafter, head = tiny_drafter(config), tiny_head(config)
    hidden, ids = _row(0, 12)
    positions = torch.arange(12)[None]
    docs = torch.zeros(1, 12, dtype=torch.long)
    anchors = torch.tensor([[5, 7]])
    train = _train_path(drafter, head, hidden, ids, positions, docs, anchors)

    for block, anchor in enumerate([5, 7]):
        cache = DraftCache()
        # Extend in two pieces, as decoding appends the accepted tokens step by step.
        drafter.extend_cache(cache, hidden[:, :2], positions[:, :2])
        drafter.extend_cache(cache, hidden[:, 2:anchor], positions[:, 2:anchor])
        block_ids = torch.full((1, config.block_size), config.mask_token_id)
        block_ids[0, 0] = ids[0, anchor]
        decoded = drafter.draft_block(cache, head.embed(block_ids), start=anchor)
        torch.testing.assert_close(decoded[0], train[0, block], rtol=1e-5, atol=1e-5)


def test_context_at_or_after_the_anchor_is_invisible() -> None:
    """docs/design.md §8 trap 2: the anchor's own hidden state does not exist yet at drafting time."""
    drafter, head = tiny_drafter(), tiny_head(tiny_config())
    hidden, ids = _row(1, 12)
    positions, docs, anchors = (
        torch.arange(12)[None],
        torch.zeros(1, 12, dtype=torch.long),
        torch.tensor([[6]]),
    )
    base = _train_path(drafter, head, hidden, ids, positions, docs, anchors)
    later = hidden.clone()
    later[:, 6:] += 5.0
    torch.testing.assert_close(
        _train_path(drafter, head, later, ids, positions, docs, anchors), base
    )
    before = hidden.clone()
    before[:, 5] += 5.0
    assert not torch.allclose(
        _train_path(drafter, head, before, ids, positions, docs, anchors), base
    )


def test_blocks_do_not_see_each_other() -> None:
    """docs/design.md §8 trap 4: changing one block's anchor token leaves every other block unchanged."""
    drafter, head = tiny_drafter(), tiny_head(tiny_config())
    hidden, ids = _row(2, 16)
    positions, docs = torch.arange(16)[None], torch.zeros(1, 16, dtype=torch.long)
    anchors = torch.tensor([[3, 8, 12]])
    base = _train_path(drafter, head, hidden, ids, positions, docs, anchors)
    changed = ids.clone()
    changed[0, 8] = (changed[0, 8] + 1) % 90
    out = _train_path(drafter, head, hidden, changed, positions, docs, anchors)
    torch.testing.assert_close(out[:, [0, 2]], base[:, [0, 2]])
    assert not torch.allclose(out[:, 1], base[:, 1])


@pytest.mark.parametrize("sliding", [False, True])
def test_sliding_layers_are_causal_inside_the_block(sliding: bool) -> None:
    """docs/design.md §8 trap 5: with only sliding layers, slot s never depends on later slots."""
    kind = "sliding_attention" if sliding else "full_attention"
    config = tiny_config(layer_types=[kind, kind], sliding_window=4 if sliding else None)
    drafter = tiny_drafter(config)
    hidden, _ = _row(3, 10)
    positions = torch.arange(10)[None]
    cache = DraftCache()
    drafter.extend_cache(cache, hidden[:, :6], positions[:, :6])
    embeds = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(0))
    base = drafter.draft_block(cache, embeds, 6)
    poked = embeds.clone()
    poked[0, 2] += 1.0
    out = drafter.draft_block(cache, poked, 6)
    changed = [not torch.allclose(out[0, s], base[0, s]) for s in range(4)]
    assert changed == ([False, False, True, True] if sliding else [True, True, True, True])


def test_rope_is_relative_over_context_and_block_keys() -> None:
    """docs/design.md §8 trap 7: shifting every position (context keys, block queries and keys) by the same
    offset changes nothing; shifting the block alone relative to its context does."""
    drafter, head = tiny_drafter(), tiny_head(tiny_config())
    hidden, ids = _row(4, 12)
    docs, anchors = torch.zeros(1, 12, dtype=torch.long), torch.tensor([[4, 9]])
    positions = torch.arange(12)[None]
    base = _train_path(drafter, head, hidden, ids, positions, docs, anchors)
    shifted = _train_path(drafter, head, hidden, ids, positions + 37, docs, anchors)
    torch.testing.assert_close(shifted, base, rtol=1e-4, atol=1e-4)

    cache_a, cache_b = DraftCache(), DraftCache()
    drafter.extend_cache(cache_a, hidden[:, :9], positions[:, :9])
    drafter.extend_cache(cache_b, hidden[:, :9], positions[:, :9] - 1)  # context one step off
    block_ids = torch.full((1, 4), 96)
    block_ids[0, 0] = ids[0, 9]
    embeds = head.embed(block_ids)
    assert not torch.allclose(
        drafter.draft_block(cache_a, embeds, 9), drafter.draft_block(cache_b, embeds, 9)
    )


def test_fp32_residual_stream_under_bf16_autocast() -> None:
    """`drafter.residual_dtype = "float32"` (speculators' numerics): under bf16 autocast with
    bf16 target features (CUDA's training numerics, on the CPU here) every layer reads and
    returns an fp32 residual stream, where by default it is bf16; the projections still run
    in bf16, the returned states are bf16 either way (the LM head's dtype), and they come
    closer to the fp32 forward's. What autocast saves for the backward grows by what the
    preflight estimate counts (10 bytes per query token, hidden unit and layer, plus 2).
    Without autocast, on fp32 features, it changes nothing, bit for bit."""
    drafter, head = tiny_drafter(), tiny_head(tiny_config())
    hidden, ids = _row(3, 48)
    positions, docs = torch.arange(48)[None], torch.zeros(1, 48, dtype=torch.long)
    anchors = torch.tensor([[2, 9, 17, 25, 31]])
    args = (drafter, head, hidden, ids, positions, docs, anchors)
    with torch.no_grad():
        exact = _train_path(*args)
        assert torch.equal(_train_path(*args, residual=torch.float32), exact)

    seen: list[tuple[torch.dtype, torch.dtype]] = []
    hooks = [
        layer.register_forward_hook(lambda m, inp, out: seen.append((inp[0].dtype, out.dtype)))
        for layer in drafter.layers
    ]
    low = (drafter, head, hidden.bfloat16(), ids, positions, docs, anchors)
    errors, saved = {}, {}
    for residual, dtype in ((None, torch.bfloat16), (torch.float32, torch.float32)):
        seen.clear()
        storages: dict[int, int] = {}

        def keep(x: torch.Tensor, into: dict[int, int] = storages) -> torch.Tensor:
            into[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
            return x

        with (
            torch.autograd.graph.saved_tensors_hooks(keep, lambda x: x),
            torch.autocast("cpu", dtype=torch.bfloat16),
        ):
            out = _train_path(*low, residual=residual)
        assert seen == [(dtype, dtype)] * len(drafter.layers)
        assert out.dtype == torch.bfloat16
        errors[dtype] = float((out.detach().float() - exact).norm() / exact.norm())
        saved[dtype] = sum(storages.values())
    for hook in hooks:
        hook.remove()
    assert errors[torch.float32] < 0.8 * errors[torch.bfloat16], errors  # 0.0024 vs 0.0036
    per_unit = (saved[torch.float32] - saved[torch.bfloat16]) / out[0].numel()  # Q * H
    layers = len(drafter.layers)
    assert 10 * layers + 2 <= per_unit < 10 * layers + 3, per_unit  # measured 22.4 (2 layers)


def test_init_is_seeded_and_norms_start_at_one() -> None:
    from flashdraft.model.drafter import init_seeded

    a, b = init_seeded(tiny_config(), 5), init_seeded(tiny_config(), 5)
    for (name, p), q in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(p, q)
        if name.endswith("norm.weight"):
            assert torch.equal(p, torch.ones_like(p))


@pytest.mark.gpu
def test_compiled_flex_drafter_matches_sdpa_forward_and_gradients_cuda() -> None:
    """The CUDA training path (compiled layers, flex BlockMask, bf16 autocast) against the
    dense SDPA path in fp32, on the same weights and a packed row."""
    from flashdraft.train.blocks import label_positions, sample_anchors, slot_weights
    from flashdraft.train.parallel import compile_drafter
    from flashdraft.train.step import DraftBatch, batch_normaliser, draft_loss

    config = tiny_config(
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        block_size=16,
        vocab_size=1000,
        mask_token_id=999,
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=64,
    )
    gen = torch.Generator().manual_seed(0)
    ctx = 1024
    docs = torch.cumsum((torch.rand(ctx, generator=gen) < 0.01).long(), 0)
    positions = torch.cat([torch.arange(int((docs == d).sum())) for d in docs.unique()])
    loss_mask = (torch.rand(ctx, generator=gen) < 0.8).long()
    anchors, valid = sample_anchors(loss_mask, docs, 48, gen)
    batch = DraftBatch(
        input_ids=torch.randint(0, 999, (1, ctx), generator=gen),
        position_ids=positions[None],
        doc_ids=docs[None],
        loss_mask=loss_mask[None],
        anchors=anchors[None],
        anchor_valid=valid[None],
        target_hidden=torch.randn(1, ctx, 2 * 256, generator=gen),
        next_tokens=torch.randint(
            0, 999, label_positions(anchors[None], 16, ctx).shape, generator=gen
        ),
    ).to(torch.device("cuda"))
    head = tiny_head(config)
    head.embedding.cuda()
    head.weight = head.weight.cuda()
    slot_w = slot_weights(16, 7.0).cuda()
    norm = batch_normaliser(batch, 16, slot_w)

    ref = tiny_drafter(config).cuda()
    loss_ref, _ = draft_loss(ref, head, batch, slot_w, norm, "sdpa", 256)
    loss_ref.backward()

    fast = compile_drafter(tiny_drafter(config).cuda())
    bf16 = DraftBatch(
        **{
            **{f: getattr(batch, f) for f in batch.__slots__},
            "target_hidden": batch.target_hidden.bfloat16(),
        }
    )
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss_fast, _ = draft_loss(fast, head, bf16, slot_w, norm, "flex", 256)
    loss_fast.backward()
    assert abs(float(loss_fast) - float(loss_ref)) / float(loss_ref) < 2e-2
    for (name, p_ref), p_fast in zip(ref.named_parameters(), fast.parameters(), strict=True):
        rel = (p_fast.grad.float() - p_ref.grad).norm() / p_ref.grad.norm().clamp(min=1e-12)
        assert rel < 5e-2, (name, float(rel))


def test_draft_block_matches_a_hand_written_spec_section_2_reference() -> None:
    """docs/design.md §2 written out by hand for one block: ctx = hidden_norm(fc(taps)) once (not each
    layer's input_layernorm); per layer q = q_norm(q_proj(xn)), k = k_norm(k_proj([ctx ; xn])),
    v = v_proj([ctx ; xn]), context rows first, RoPE at absolute positions, bidirectional in
    the block, GQA; pre-norm residuals, SwiGLU, final norm. Both drafter paths are checked
    equal to each other elsewhere; this pins what they compute (non-unit norms everywhere)."""
    from flashdraft.model.drafter import apply_rope

    config = tiny_config()
    drafter = tiny_drafter(config, seed=3)
    head = tiny_head(config)
    gen = torch.Generator().manual_seed(0)
    a, b, h = 7, config.block_size, config.hidden_size
    taps = torch.randn(1, a, config.num_taps * h, generator=gen)
    block_ids = torch.tensor([[5] + [config.mask_token_id] * (b - 1)])

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + config.rms_norm_eps)

    def heads(x: torch.Tensor, n: int) -> torch.Tensor:  # [T, n*D] -> [n, T, D]
        return x.view(x.shape[0], n, config.head_dim).transpose(0, 1)

    with torch.no_grad():
        ctx = rms(taps[0] @ drafter.fc.weight.T, drafter.hidden_norm.weight)  # [a, H]
        positions = torch.arange(a + b)[None]
        cos, sin = drafter.rotary(positions, torch.float32)
        x = head.embed(block_ids)[0]  # [B, H]
        groups = config.num_attention_heads // config.num_key_value_heads
        for layer in drafter.layers:
            at = layer.self_attn
            xn = rms(x, layer.input_layernorm.weight)
            kv_in = torch.cat([ctx, xn])  # context rows first, then the block
            q = rms(heads(xn @ at.q_proj.weight.T, config.num_attention_heads), at.q_norm.weight)
            k = rms(heads(kv_in @ at.k_proj.weight.T, config.num_key_value_heads), at.k_norm.weight)
            v = heads(kv_in @ at.v_proj.weight.T, config.num_key_value_heads)
            q = apply_rope(q[None], cos[:, a:], sin[:, a:])[0]  # block positions a..a+B-1
            k = apply_rope(k[None], cos, sin)[0]  # context 0..a-1, then the block
            k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
            scores = (q @ k.transpose(1, 2)) * config.head_dim**-0.5  # all visible
            attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(b, -1)
            x = x + attn @ at.o_proj.weight.T
            xn = rms(x, layer.post_attention_layernorm.weight)
            mlp = layer.mlp
            gate, up = xn @ mlp.gate_proj.weight.T, xn @ mlp.up_proj.weight.T
            x = x + (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.T
        want = rms(x, drafter.norm.weight)

        cache = DraftCache()
        drafter.extend_cache(cache, taps, positions[:, :a])
        got = drafter.draft_block(cache, head.embed(block_ids), start=a)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("kinds", "window"),
    [(["sliding_attention", "full_attention"], 3), (["sliding_attention"] * 2, 6)],
    ids=["mixed-W<B", "sliding-W>B"],
)
def test_decode_equals_training_over_a_long_decode(kinds: list[str], window: int) -> None:
    """docs/design.md §8 trap 5 over many steps: the decode cache appends a few tokens at a time (its
    buffers reallocate and the sliding layers drop what their window no longer sees), and
    every block still equals the training path's block at the same anchor."""
    config = tiny_config(layer_types=kinds, sliding_window=window, block_size=4)
    drafter, head = tiny_drafter(config), tiny_head(config)
    length = 200
    hidden, ids = _row(7, length)
    positions, docs = torch.arange(length)[None], torch.zeros(1, length, dtype=torch.long)
    anchors = torch.tensor([[5, 66, 130, 190]])
    train = _train_path(drafter, head, hidden, ids, positions, docs, anchors)
    cache, done = DraftCache(), 0
    for block, anchor in enumerate(anchors[0].tolist()):
        while done < anchor:  # 1..4 verified tokens per step, as decoding appends them
            step = min(1 + done % 4, anchor - done)
            span = slice(done, done + step)
            drafter.extend_cache(cache, hidden[:, span], positions[:, span])
            done += step
        block_ids = torch.full((1, 4), config.mask_token_id)
        block_ids[0, 0] = ids[0, anchor]
        decoded = drafter.draft_block(cache, head.embed(block_ids), start=anchor)
        torch.testing.assert_close(decoded[0], train[0, block], rtol=1e-5, atol=1e-5)
    held = [k.shape[2] for k in cache.keys]
    assert held == [window - 1 if k == "sliding_attention" else length - 10 for k in kinds]
    for kind, rows in zip(kinds, cache.capacity, strict=True):
        assert rows <= (window - 1 + 4 + 64 if kind == "sliding_attention" else 2 * length)


def test_decode_cache_crop() -> None:
    """Undoing the last append works; cropping past what a sliding layer still holds fails."""
    config = tiny_config(layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    drafter = tiny_drafter(config)
    hidden, _ = _row(8, 120)
    positions = torch.arange(120)[None]
    cache = DraftCache()
    drafter.extend_cache(cache, hidden[:, :12], positions[:, :12])
    before = [k.clone() for k in cache.keys]
    drafter.extend_cache(cache, hidden[:, 12:16], positions[:, 12:16])
    cache.crop(12)
    assert cache.length == 12
    for k, k0 in zip(cache.keys, before, strict=True):
        assert torch.equal(k, k0)
    for start in range(12, 120, 4):  # the sliding layer's buffer fills and drops old rows
        drafter.extend_cache(cache, hidden[:, start : start + 4], positions[:, start : start + 4])
    cache.crop(116)
    with pytest.raises(ValueError, match="no longer holds the window"):
        cache.crop(12)
    with pytest.raises(ValueError, match="cannot crop"):
        cache.crop(117)
