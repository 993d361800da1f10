"""The frozen target in FP8 (`flashdraft.model.fp8`, `target.precision = "fp8"`): the
quantisation against an independent e4m3 rounding, the emulated product against a reference
quantise-dequantise computation (and torch's own `_scaled_mm` where the CPU has it), tiny
dense and hybrid targets converted (taps and logits within stated tolerances of the original,
nothing else touched), the start-up checks, and where FP8 is refused."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from helpers import drafter_config_for, random_packed_row, tiny_hybrid, tiny_llama, train_settings
from torch import nn

from flashdraft.eval.evaluate import evaluate_drafter
from flashdraft.eval.report import FP8_TIE_TOLERANCE
from flashdraft.model import fp8
from flashdraft.model.drafter import DFlashDrafter
from flashdraft.model.fp8 import FP8Linear, emulated_scaled_mm, quantize_rows
from flashdraft.model.target import (
    Target,
    decoder_layers,
    set_precision,
    tap_errors,
)
from flashdraft.train.config import load_run_config
from flashdraft.train.features import load_run_target
from flashdraft.train.parallel import DistInfo, compile_target
from flashdraft.train.plan import plan_run


def e4m3_reference(v: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even onto float8_e4m3fn's values, written from the format (3
    mantissa bits, exponent bias 7, subnormal step 2^-9, max 448), in float64; |v| <= 448."""
    magnitude = np.abs(v)
    exponent = np.floor(np.log2(np.maximum(magnitude, 2.0**-9)))
    step = 2.0 ** (np.maximum(exponent, -6) - 3)  # normals: 3 bits below the leading one
    return np.sign(v) * np.round(magnitude / step) * step  # np.round: half to even


def rows_to_quantise() -> torch.Tensor:
    """Rows of every kind: Gaussian, heavy-tailed, tiny (subnormal after scaling), all zero."""
    gen = torch.Generator().manual_seed(0)
    normal = torch.randn(6, 96, generator=gen)
    heavy = torch.randn(6, 96, generator=gen) * torch.rand(6, 96, generator=gen).pow(-2)
    spread = torch.randn(2, 96, generator=gen) * torch.logspace(-6, 0, 96)
    return torch.cat([normal, heavy, spread, torch.zeros(1, 96)])


def test_row_quantisation_equals_an_independent_e4m3_rounding() -> None:
    x = rows_to_quantise()
    q, scale = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (len(x), 1)
    amax = x.abs().amax(-1, keepdim=True).clamp(min=fp8.AMAX_FLOOR)
    assert torch.equal(scale, amax / 448.0)  # fp32 arithmetic, as the reference does it
    scaled = (x / scale).numpy().astype(np.float64)  # IEEE fp32 division, then exact
    assert np.array_equal(q.float().numpy().astype(np.float64), e4m3_reference(scaled))
    assert torch.equal(q[-1].float(), torch.zeros(96))  # an all-zero row stays zero
    nonzero = x.abs().amax(-1) > 0
    assert bool((q.float().abs().amax(-1)[nonzero] == 448).all())  # each row's whole range


def test_the_quantisation_error_is_within_half_an_e4m3_step() -> None:
    """|x - dq(q(x))| <= 2^-4 |x| (normals: half a step of 3 mantissa bits) or, below the
    normal range, half the subnormal step 2^-10 times the row's scale."""
    x = rows_to_quantise()
    q, scale = quantize_rows(x)
    error = (q.float() * scale - x).abs()
    bound = torch.maximum(x.abs() * 2.0**-4, scale * 2.0**-10)
    assert bool((error <= bound * (1 + 1e-6)).all()), float((error / bound).max())
    assert 0.4 < float((error / bound).max()) <= 1 + 1e-6  # the bound is reached, not loose


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_emulated_fp8_linear_equals_a_reference_quantise_dequantise(dtype) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=True).to(dtype).requires_grad_(False)
    x = (torch.randn(2, 7, 64) * torch.linspace(0.1, 3.0, 64)).to(dtype)
    module = FP8Linear.from_linear(linear)
    assert module.weight.dtype == torch.float8_e4m3fn and module.weight_scale.shape == (48,)
    got = module(x)
    assert got.shape == (2, 7, 48) and got.dtype == dtype
    # Reference: both sides rounded by the independent e4m3 rule, dequantised, multiplied
    # in float64.
    rows = x.reshape(-1, 64).double()
    x_scale = (x.reshape(-1, 64).float().abs().amax(-1, keepdim=True) / 448).double()
    w_scale = (linear.weight.float().abs().amax(-1, keepdim=True) / 448).double()
    xq = e4m3_reference((rows.float() / x_scale.float()).double().numpy())
    wq = e4m3_reference((linear.weight.float() / w_scale.float()).double().numpy())
    x_dq, w_dq, bias = xq * x_scale.numpy(), wq * w_scale.numpy(), linear.bias.double().numpy()
    expected = torch.from_numpy(x_dq @ w_dq.T + bias).reshape(2, 7, 48)
    assert np.array_equal(module.weight.double().numpy(), wq)  # the same e4m3 values
    assert torch.equal(module.weight_scale, w_scale[:, 0].float())
    # Rounding allowed, per element, relative to the sum of the terms' magnitudes: fp32
    # accumulation over K = 64 (as the tensor cores); in bf16 also the product's and the
    # bias sum's roundings to bf16.
    magnitude = torch.from_numpy(np.abs(x_dq) @ np.abs(w_dq).T + np.abs(bias)).reshape(2, 7, 48)
    allowed = {torch.float32: 64 * 2.0**-24, torch.bfloat16: 2.0**-7}[dtype] * magnitude
    assert bool(((got.double() - expected).abs() <= allowed).all())


def test_the_emulation_agrees_with_torch_scaled_mm_where_the_cpu_has_it() -> None:
    """torch's own row-wise `_scaled_mm` (a CPU kernel in recent torch) as the oracle."""
    gen = torch.Generator().manual_seed(3)
    xq, x_scale = quantize_rows(torch.randn(9, 64, generator=gen))
    wq, w_scale = quantize_rows(torch.randn(32, 64, generator=gen))
    ours = emulated_scaled_mm(xq, wq, x_scale, w_scale[:, 0], torch.float32)
    try:
        theirs = torch._scaled_mm(
            xq, wq.t(), scale_a=x_scale, scale_b=w_scale.t(), out_dtype=torch.float32
        )
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"no CPU _scaled_mm with row-wise scales in torch {torch.__version__}: {err}")
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


def parameters_by_name(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters()) | dict(model.named_buffers())


@pytest.mark.parametrize("kind", ["llama", "qwen3_5_moe", "qwen3_next"])
def test_conversion_replaces_the_decoder_linears_and_touches_nothing_else(kind) -> None:
    model = tiny_llama() if kind == "llama" else tiny_hybrid(kind)
    before = {k: (v, v.clone()) for k, v in parameters_by_name(model).items()}
    originals = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and ".layers." in name
    }
    count = set_precision(model, "fp8")
    converted = {n for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    kept = {"in_proj_a", "in_proj_b", "in_proj_ba", "shared_expert_gate"}  # KEEP; 1 output
    expected = {n for n in originals if n.rsplit(".", 1)[-1] not in kept}
    assert converted == expected and count == len(expected) > 0
    after = parameters_by_name(model)
    for name, (tensor, value) in before.items():
        module_name = name.rsplit(".", 1)[0]
        if module_name in converted:
            assert name not in after or after[name].dtype in (torch.float8_e4m3fn, torch.float32)
        else:  # the same tensor, unchanged: embeddings, LM head, norms, convolutions, experts
            assert after[name] is tensor and torch.equal(tensor, value), name
    for name in converted:  # the replaced bf16 modules were read, never written
        assert torch.equal(originals[name].weight, before[f"{name}.weight"][1])
    assert not any(isinstance(m, FP8Linear) for m in (model.lm_head, model.model.embed_tokens))
    assert set_precision(model, "fp8") == 0  # already converted: nothing to do
    assert fp8.precision_of(model) == "fp8"


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# Measured on these tiny random targets (CPU, fp32 and bf16, 40 tokens): dense taps 0.02-0.08
# from the first to the last layer, logits 0.05-0.08; the hybrids' larger weights (N(0, 0.15))
# and recurrent state 0.09-0.32, logits 0.20-0.31. A conversion that broke a scale or a layer
# (a wrong axis, a transposed weight) puts them near 1.
TOLERANCE = {"llama": 0.12, "qwen3_5": 0.3, "qwen3_next": 0.45}


@pytest.mark.parametrize("kind", sorted(TOLERANCE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_targets_stay_within_a_stated_tolerance_of_the_original(kind, dtype) -> None:
    model = (tiny_llama() if kind == "llama" else tiny_hybrid(kind)).to(dtype)
    quantised = copy.deepcopy(model)
    set_precision(quantised, "fp8")
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ref = model(input_ids=ids, output_hidden_states=True, use_cache=False)
        out = quantised(input_ids=ids, output_hidden_states=True, use_cache=False)
    errors = [
        relative(a, b) for a, b in zip(out.hidden_states[1:], ref.hidden_states[1:], strict=True)
    ]
    assert min(errors) > 1e-3 and max(errors) < TOLERANCE[kind], errors
    assert relative(out.logits, ref.logits) < TOLERANCE[kind]
    agree = float((out.logits.argmax(-1) == ref.logits.argmax(-1)).float().mean())
    assert agree >= 0.7, agree


def test_the_startup_checks_pass_on_fp8_targets() -> None:
    """The tap check (hooks vs hidden_states of the same FP8 forward) on a dense target; on a
    hybrid also the packing check, whose per-token activation scales keep documents apart."""
    dense = tiny_llama()
    set_precision(dense, "fp8")
    target = Target(dense, [0, 2], "sdpa")
    target.verify_taps()
    target.taps.remove()
    hybrid = tiny_hybrid("qwen3_5").to(torch.bfloat16)
    set_precision(hybrid, "fp8")
    target = Target(hybrid, [0, 1, 3], "sdpa")
    try:
        target.verify_taps()
    finally:
        target.taps.remove()
        assert target.linear is not None
        target.linear.remove()


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_an_fp8_hybrid_gets_a_wider_path_tolerance(monkeypatch, precision) -> None:
    """The packing check with every document off its run alone by 0.23 (relative), between
    the bf16 path tolerance (0.15) and FP8's (x FP8_PATH_GAIN = 0.45): FP8 requantisation
    amplifies the paths' rounding; bf16 refuses the first document, FP8 passes (the later
    one is held to twice the first one's error plus PACKING_TOLERANCE)."""
    model = tiny_hybrid("qwen3_5").to(torch.bfloat16)
    set_precision(model, precision)
    target = Target(model, [0], "sdpa", linear_kernels="per-document")
    alone = target._document_alone

    def off(doc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        taps, labels, logits = alone(doc)
        return taps * 1.3, labels, logits  # ||x - 1.3 x|| / ||1.3 x|| = 0.23

    monkeypatch.setattr(target, "_document_alone", off)
    try:
        if precision == "bf16":
            with pytest.raises(ValueError, match="nothing precedes the first document"):
                target.verify_packing()
        else:
            target.verify_packing()
    finally:
        target.taps.remove()
        assert target.linear is not None
        target.linear.remove()


def test_fp8_is_refused_in_one_line_where_it_cannot_run(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100")
    why = fp8.fp8_refusal(torch.device("cuda"))
    assert why is not None and "sm_80" in why and "sm_89+" in why
    assert fp8.fp8_refusal(torch.device("cpu")) is None  # emulated
    model = tiny_llama().to("meta")
    with pytest.raises(ValueError, match=r"^precision 'fp8': no FP8 path on meta.*'bf16'") as err:
        set_precision(model, "fp8")
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="one of bf16, fp8"):
        set_precision(tiny_llama(), "fp4")


def test_the_run_config_key(tmp_path) -> None:
    base = [f"output={tmp_path}", "target.path=t", 'data.datasets=["d"]']
    assert load_run_config(None, base).target.precision == "bf16"
    assert load_run_config(None, [*base, "target.precision=fp8"]).target.precision == "fp8"
    with pytest.raises(ValueError, match=r"target\.precision = 'fp16' is not allowed"):
        load_run_config(None, [*base, "target.precision=fp16"])
    with pytest.raises(ValueError, match=r"not with parallel\.shard_target"):
        load_run_config(None, [*base, "target.precision=fp8", "parallel.shard_target=true"])


def test_a_cpu_run_loads_its_target_in_fp8_emulated(tmp_path, tiny_qwen3_dir, qwen_data) -> None:
    """`target.precision = "fp8"` on a CPU run: the run's target (loaded, checked) has FP8
    linear layers, and a row's taps and labels are that forward's, near the bf16 run's."""
    one = DistInfo(rank=0, world=1, local_rank=0, device=torch.device("cpu"))
    targets = {}
    for precision in ("bf16", "fp8"):
        args = train_settings(tmp_path / precision, tiny_qwen3_dir, qwen_data)
        config = load_run_config(None, [*args[1::2], f"target.precision={precision}"])
        targets[precision] = load_run_target(plan_run(config, one, resume=False), "sdpa")
    assert fp8.precision_of(targets["fp8"].model) == "fp8"
    assert fp8.precision_of(targets["bf16"].model) == "bf16"
    layers = decoder_layers(targets["fp8"].model)
    assert isinstance(layers[0].mlp.down_proj, FP8Linear)
    ids = torch.randint(0, 151936, (1, 64), generator=torch.Generator().manual_seed(0))
    positions, docs = torch.arange(64)[None], torch.zeros(1, 64, dtype=torch.long)
    every = torch.arange(64)[None]
    out = {k: t.packed_outputs(ids, positions, docs, every) for k, t in targets.items()}
    errors = tap_errors(out["fp8"].features[0], out["bf16"].features[0], targets["fp8"].taps)
    assert 1e-3 < max(errors) < 0.12, errors
    labels = [o.next_tokens for o in out.values()]
    assert labels[0] is not None and labels[1] is not None
    assert float((labels[0] == labels[1]).float().mean()) >= 0.7


def test_speculative_decoding_on_an_fp8_target_stays_lossless() -> None:
    """Per-token activation scales: a verify forward of B tokens quantises each token as
    decoding it alone would, so T = 0 speculative decoding equals the FP8 target's greedy
    decoding; the report says the target ran in FP8, and that its ties were judged at FP8's
    own rounding noise (on a real model the two paths can round apart: report.py)."""
    target = tiny_llama(initializer_range=0.3)
    set_precision(target, "fp8")
    drafter = DFlashDrafter(drafter_config_for(target, block_size=4))
    drafter.reset_parameters(seed=0)
    report = evaluate_drafter(
        target, None, drafter, [[5, 17, 3, 42], [8, 11, 29]], max_new_tokens=12, reference=True
    )
    assert report["lossless"] is True
    assert report["settings"]["target_precision"] == "fp8"
    assert report["settings"]["tie_tolerance"] == FP8_TIE_TOLERANCE


# ---- CUDA (sm_89+): the tensor cores' product, the 8B-shaped stack, compiled forward ----


def fp8_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    why = fp8.fp8_refusal(torch.device("cuda"))
    if why is not None:
        pytest.skip(why)


@pytest.mark.gpu
def test_scaled_mm_equals_the_emulation_on_cuda() -> None:
    """The same quantised operands through `torch._scaled_mm` and through the emulation:
    fp32 accumulation both, only the order differs, so the bf16 results agree to rounding.
    M = 1000 rows (not a multiple of 16), a projection of Qwen3-8B's width."""
    fp8_cuda()
    torch.manual_seed(0)
    linear = nn.Linear(4096, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
    module = FP8Linear.from_linear(linear.requires_grad_(False))
    x = torch.randn(1000, 4096, device="cuda", dtype=torch.bfloat16)
    got = module(x)
    xq, x_scale = quantize_rows(x)
    emulated = emulated_scaled_mm(xq, module.weight, x_scale, module.weight_scale, torch.bfloat16)
    torch.testing.assert_close(got, emulated, rtol=2**-7, atol=1e-3 * float(emulated.abs().max()))
    assert relative(got, linear(x)) < 0.06  # and near bf16's product (measured ~0.04 on CPU)


@pytest.mark.gpu
def test_fp8_taps_of_a_qwen3_8b_shaped_stack_stay_near_bf16() -> None:
    """Three random layers of Qwen3-8B's shape (HF init), 512 tokens, bf16: FP8 taps within
    0.25 (relative) of the bf16 taps. The CPU emulation of the same stack at 64 tokens gave
    0.117, 0.150, 0.177 by layer (random weights: each layer's update dominates its tap)."""
    fp8_cuda()
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=4096, hidden_size=4096, intermediate_size=12288, num_hidden_layers=3,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        tie_word_embeddings=False, attn_implementation="sdpa",
    )  # fmt: skip
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval().requires_grad_(False)
    ids = torch.randint(0, 4096, (1, 512), device="cuda")
    with torch.inference_mode():
        ref = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
        set_precision(model, "fp8")
        out = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
    errors = [relative(a, b) for a, b in zip(out[1:], ref[1:], strict=True)]
    assert min(errors) > 0.01 and max(errors) < 0.25, errors


@pytest.mark.gpu
@pytest.mark.parametrize("scope", ["layers", "stack"])
def test_the_compiled_fp8_target_on_cuda(tiny_qwen3_dir, scope) -> None:
    """bf16 + FP8, flex attention: the start-up check passes, the compiled forward gives the
    eager taps (to rounding) and labels, with no graph break and no recompile on new rows."""
    fp8_cuda()
    from torch._dynamo.utils import counters

    from flashdraft.model.target import load_target

    model = load_target(str(tiny_qwen3_dir), "bfloat16", "flex_attention", "cuda", "fp8")
    assert fp8.precision_of(model) == "fp8"
    target = Target(model, [1, 3], "flex")
    target.verify_taps()
    labels_at = torch.arange(200, device="cuda")[None]
    rows = [tuple(t.cuda() for t in random_packed_row(s, 256)) for s in range(3)]
    eager = [target.packed_outputs(*row, labels_at) for row in rows]
    torch._dynamo.reset()
    counters.clear()
    compile_target(target, scope=scope)
    graphs, compiled = [], []
    for row in rows:
        compiled.append(target.packed_outputs(*row, labels_at))
        graphs.append(int(counters["stats"]["unique_graphs"]))
    assert graphs[0] == graphs[-1], graphs  # no recompile for new rows
    assert not counters["graph_break"], dict(counters["graph_break"])
    for a, b in zip(eager, compiled, strict=True):
        assert relative(b.features, a.features) < 2e-2
        assert float((a.next_tokens == b.next_tokens).float().mean()) > 0.95
    target.taps.remove()


@pytest.mark.parametrize("kind", ["llama", "qwen3_5"])
def test_static_decoding_runs_an_fp8_target_without_fusing_it(kind) -> None:
    """The static KV-cache forward (eval's and generate's fast loops) over FP8 layers: its
    start-up check against the HF forward of the same FP8 model passes, and the q/k/v and
    gate/up weights are never concatenated (an FP8Linear is no nn.Linear, so
    `static_layers.fusable` says no)."""
    from flashdraft.model.static import StaticLM

    model = tiny_llama() if kind == "llama" else tiny_hybrid(kind)
    set_precision(model, "fp8")
    lm = StaticLM(model, 1, 64, [1, 2])
    assert lm.fuse_projections() is False
    lm.verify()


def test_eval_and_generate_take_the_precision_flag() -> None:
    """`--precision fp8` on both commands (flags derived from their configs); generate's
    records carry it only when it is fp8, so outputs written before the flag stay resumable."""
    import argparse

    from flashdraft import config as cfg
    from flashdraft.data.generate import GenerateConfig
    from flashdraft.eval.evaluate import EvalConfig

    needed = {
        EvalConfig: ["--target", "t", "--drafter", "d", "--prompts", "p", "--output", "o.json"],
        GenerateConfig: ["--target", "t", "--prompts", "p", "--output", "o.jsonl"],
    }
    configs = {}
    for cls, args in needed.items():
        parser = argparse.ArgumentParser()
        cfg.add_arguments(parser, cls)
        assert cfg.from_args(cls, parser.parse_args(args)).precision == "bf16"
        configs[cls] = cfg.from_args(cls, parser.parse_args([*args, "--precision", "fp8"]))
        assert configs[cls].precision == "fp8"
        with pytest.raises(SystemExit):
            parser.parse_args([*args, "--precision", "int8"])
    generate = configs[GenerateConfig]
    assert generate.settings([1])["precision"] == "fp8"
    generate.precision = "bf16"
    assert "precision" not in generate.settings([1])


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_next"])
def test_an_fp8_hybrid_passes_the_startup_check_on_cuda(kind) -> None:
    """bf16 + FP8 on fla's varlen kernels (the eager path quantises through the compiled
    row quantiser): the packing check, FP8 path tolerance included, passes."""
    fp8_cuda()
    from flashdraft.model import hybrid

    kernels, why = hybrid.fla_kernels()
    if kernels is None:
        pytest.skip(why)
    model = tiny_hybrid(kind).to("cuda", torch.bfloat16)
    set_precision(model, "fp8")
    target = Target(model, [0, 1, 3], "sdpa")  # "auto": fla on CUDA
    assert target.linear is not None and target.linear.kernels is not None
    try:
        target.verify_taps()
    finally:
        target.taps.remove()
        target.linear.remove()


# ---- FP8 products of a trained layer (experimental: bench/trainer.py --drafter-fp8) ----


def test_fp8_products_equal_their_quantised_reference_forward_and_backward() -> None:
    """The forward and both backward products are the products of the row-wise quantised
    operands (each scaled along its contraction), and stay near the full-precision ones."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=False)
    reference = copy.deepcopy(linear)
    state = {k: v.clone() for k, v in linear.state_dict().items()}
    assert fp8.fp8_products(nn.Sequential(linear)) == 1
    assert isinstance(linear, fp8.FP8TrainedLinear) and linear.state_dict().keys() == state.keys()
    x = torch.randn(2, 16, 64, requires_grad=True)
    g = torch.randn(2, 16, 48)
    y = linear(x)
    y.backward(g)

    def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # a @ b^T, quantised
        (aq, sa), (bq, sb) = quantize_rows(a), quantize_rows(b)
        return (aq.double() * sa.double()) @ (bq.double() * sb.double()).t()

    rows, grads, w = x.detach().reshape(32, 64), g.reshape(32, 48), linear.weight.detach()
    expected = [product(rows, w), product(grads, w.t()), product(grads.t(), rows.t())]
    got = [y.detach().reshape(32, 48), x.grad.reshape(32, 64), linear.weight.grad]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)
    # near the full-precision layer (the e4m3 rounding of two operands: a few percent)
    x2 = x.detach().clone().requires_grad_(True)
    y2 = reference(x2)
    y2.backward(g)
    for a, b in [(y, y2), (x.grad, x2.grad), (linear.weight.grad, reference.weight.grad)]:
        assert 0.005 < relative(a.detach(), b.detach()) < 0.08
    # tokens not a multiple of 16: the plain product
    odd = torch.randn(3, 64)
    assert torch.equal(linear(odd), reference(odd))


@pytest.mark.gpu
def test_fp8_products_on_cuda_eager_and_compiled() -> None:
    """On the tensor cores, eager and compiled: the three products near the fp32 layer's
    (e4m3 operands: a few percent), with bf16 activations and gradients and fp32 master
    weights, as the drafter's step runs them under autocast."""
    fp8_cuda()
    torch.manual_seed(0)
    linear = nn.Linear(1024, 512, bias=False, device="cuda")
    reference = copy.deepcopy(linear)
    fp8.fp8_products(nn.Sequential(linear))
    x = torch.randn(4, 64, 1024, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(4, 64, 512, device="cuda", dtype=torch.bfloat16)
    results = []
    for layer in (linear, torch.compile(linear), reference):
        layer.zero_grad(set_to_none=True)
        inputs = x.clone().requires_grad_(True)
        out = layer(inputs.float() if layer is reference else inputs)
        out.backward(g.float() if layer is reference else g)
        results.append((out.detach(), inputs.grad, linear.weight.grad if layer is not reference
                        else reference.weight.grad))  # fmt: skip
    (eager, compiled, exact) = results
    for a, b, c in zip(eager, compiled, exact, strict=True):
        assert relative(b, a) < 1e-2  # compiled vs eager: the same quantisation
        assert 0.005 < relative(a, c) < 0.08
    assert eager[0].dtype == torch.bfloat16 and linear.weight.grad.dtype == torch.float32


def test_fp8_projections_concatenate_exactly() -> None:
    """q/k/v (or gate/up) as one FP8Linear: the parts' outputs side by side, bit for bit
    (per-token input scales, per-channel weight scales), for a fused static decode step."""
    torch.manual_seed(0)
    parts = [FP8Linear.from_linear(nn.Linear(64, n).requires_grad_(False)) for n in (64, 32, 32)]
    x = torch.randn(3, 5, 64)
    fused = fp8.concat_fp8(parts)
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))
    with pytest.raises(ValueError, match="biases on all parts or on none"):
        fp8.concat_fp8([parts[0], FP8Linear.from_linear(nn.Linear(64, 16, bias=False))])
