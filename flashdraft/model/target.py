"""The frozen target: loading, layer taps by forward hooks, the packed forward, labels.

Shape legend: R rows, T tokens per packed row, K tapped layers, H hidden, V vocabulary,
N label positions.

Taps follow the z-lab convention (docs/design.md §3): id i is the *output of decoder layer i*,
i.e. `hidden_states[i + 1]` of an HF forward with `output_hidden_states=True`. They are
captured with forward hooks on the decoder layers, never with `output_hidden_states` (which
keeps every layer alive), and never from `hidden_states[-1]`, which HF replaces by the
final-normed state. `Target.verify_taps` checks all of this at start-up.

Hybrid targets (linear-attention layers, `flashdraft.model.hybrid`) need more than the
document mask to pack exactly: their linear layers restart at every document start, and the
start-up check also compares a packed two-document row with each document run alone.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from flashdraft.log import get_logger
from flashdraft.model import varlen
from flashdraft.model.attention import Backend, build_document_mask
from flashdraft.model.fp8 import apply_precision, precision_of
from flashdraft.model.head import TargetHead
from flashdraft.model.hub import model_errors
from flashdraft.model.hybrid import (
    PackedLinearAttention,
    VarlenKernels,
    attention_masks,
    choose_kernels,
    conv_window,
    delta_rule_flops_per_token,
    is_hybrid,
    linear_layer_ids,
)
from flashdraft.model.routing import PinnedRouting

log = get_logger(__name__)

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
# Label rows per chunk of a start-up check's single document (`_document_alone`): fixed, so the
# compiled label chunk (`head._LABEL_CHUNK`, CUDA) has one shape for every document length.
DOCUMENT_CHUNK_ROWS = 4096
# Start-up packing check: the largest relative difference (a document's taps, ||packed -
# alone|| / ||alone||; logits for label ties) that is rounding, per target dtype. Measured on
# the tiny hybrid (tests): exact paths 1e-6 (fp32) and 6e-3 (bf16); a leak 0.2 to 0.6.
PACKING_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 2e-2}
# The first document of the start-up check's packed row (nothing precedes it, so nothing can
# leak into it) against the model's own forward: only the kernels differ (flex vs sdpa, fla's
# varlen vs its chunked kernel), and a deep random model amplifies their rounding (bf16,
# Qwen3.6-27B-shaped random target, tap of layer 31: 0.065 relative; trained weights much
# less). A later document may differ from its run alone by PACKING_TOLERANCE more than twice
# that rounding; more is a leak. The same holds over each document's first conv_window tokens
# (H200, fla, bf16, the tiny hybrids of all three kinds: 0.005-0.03 there in both documents).
PATH_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.15, torch.float16: 0.1}
# An FP8 target (`flashdraft.model.fp8`) requantises every linear layer's input: a path's
# rounding difference d that moves a value across an e4m3 rounding boundary becomes a whole
# e4m3 step s, which happens with chance ~d/s, so the rounding between paths grows ~sqrt(s/d)
# (sqrt(2^-3 / 2^-8) ~ 5.7 from bf16). Measured: document 0 of a 32-layer random hybrid, bf16
# (CPU, reference kernels), 0.0042 -> 0.021 at its last tap. Its path tolerance is this many
# times the dtype's: bf16 0.45, over the 27B-shaped random target's 0.065 x 5.7 = 0.37 (to
# be measured on CUDA); later documents keep PACKING_TOLERANCE over twice the first's error.
FP8_PATH_GAIN = 3.0


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder-layer list of an HF causal LM (Llama/Qwen/Mistral/Gemma... layouts)."""
    for path in ("model.layers", "model.language_model.layers", "transformer.h", "gpt_neox.layers"):
        obj: Any = model
        for name in path.split("."):
            obj = getattr(obj, name, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            return obj
    raise ValueError(
        f"cannot find the decoder layers of {type(model).__name__}; supported layouts: "
        "model.layers, model.language_model.layers, transformer.h, gpt_neox.layers"
    )


def base_model(model: nn.Module) -> nn.Module:
    """The decoder stack without the LM head (`model.model` for HF causal LMs)."""
    inner = getattr(model, "model", None) or getattr(model, "transformer", None)
    if inner is None:
        raise ValueError(f"{type(model).__name__} has no base model (.model / .transformer)")
    assert isinstance(inner, nn.Module)
    return inner


def load_target(
    path: str,
    dtype: str = "bfloat16",
    attn_implementation: str | None = None,
    device: torch.device | str = "cpu",
    precision: str = "bf16",
) -> nn.Module:
    """A frozen HF causal LM in eval mode, its decoder layers' linear layers in `precision`
    (`set_precision`). Never trusts remote code."""
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"target dtype {dtype!r} is not one of {sorted(DTYPES)}")
    with model_errors(path):
        model: Any = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=DTYPES[dtype],
            attn_implementation=attn_implementation,
            trust_remote_code=False,
        )
    model.eval().requires_grad_(False)
    model = model.to(device)
    set_precision(model, precision)
    return model


def set_precision(model: nn.Module, precision: str) -> int:
    """The target's decoder-layer linear layers in `precision`, in place: "bf16" (as loaded,
    in its dtype) or "fp8" (`flashdraft.model.fp8`); how many were converted."""
    return apply_precision(model, precision, decoder_layers(model))


def default_attention(path: str, device_type: str) -> str:
    """The attention implementation to load a target with. On CUDA: "varlen" (flash
    attention over the packed documents' boundaries, no mask) when torch has the varlen
    kernel and the model class runs transformers' attention interface with nothing the
    kernel lacks (`varlen.refusal`); else flex_attention (the document mask as a compiled
    BlockMask) when the class supports it; else sdpa with a dense mask. On the SmolLM2-135M
    shape varlen made the target forward 1.55x flex's on an H200 (docs/speed.md).
    transformers refuses flex for the hybrid Qwen3.5 / Qwen3-Next classes
    (5.17-5.24), so `flex_attention` there would fail at load time; their full-attention
    layers call the attention interface (without the class flag saying so), so hybrids take
    varlen too: at 32K-token rows a dense mask's sdpa computes every cross-document score."""
    if device_type != "cuda":
        return "sdpa"
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path, trust_remote_code=False)
    mapping: Any = AutoModelForCausalLM._model_mapping
    try:
        cls = mapping[type(config)]
    except KeyError:
        return "sdpa"
    interface = getattr(cls, "_supports_attention_backend", False) or is_hybrid(config)
    if interface and varlen.available() and varlen.refusal(config.get_text_config()) is None:
        return "varlen"
    return "flex_attention" if getattr(cls, "_supports_flex_attn", False) else "sdpa"


def mask_backend(model: Any, backend: Backend) -> Backend:
    """The kind of document mask the model's attention layers take: a BlockMask only when
    they run flex_attention, a dense mask otherwise (whatever the drafter uses)."""
    impl = getattr(model.config, "_attn_implementation", None)
    if backend == "flex" and impl not in (None, "flex_attention"):
        return "sdpa"
    return backend


class LayerTaps:
    """Forward hooks that keep the outputs of the tapped decoder layers of the last forward."""

    def __init__(self, model: nn.Module, layer_ids: list[int]) -> None:
        layers = decoder_layers(model)
        bad = [i for i in layer_ids if not 0 <= i < len(layers)]
        if bad:
            raise ValueError(
                f"target_layer_ids {bad} do not exist: the target has {len(layers)} decoder "
                f"layers (ids are 0-based outputs of decoder layers, 0..{len(layers) - 1})"
            )
        self.layer_ids = list(layer_ids)
        self.captured: dict[int, Tensor] = {}
        self._handles = [
            layers[i].register_forward_hook(self._hook(i)) for i in sorted(set(layer_ids))
        ]

    def _hook(self, index: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            # transformers 5.x decoder layers return a Tensor; 4.x a tuple (hidden, ...).
            self.captured[index] = output[0] if isinstance(output, tuple) else output

        return hook

    def features(self) -> Tensor:
        """[..., K*H]: the taps concatenated in `layer_ids` order, then forgotten.

        Call outside inference mode: the result is then an ordinary tensor that autograd
        may save (the drafter's fc needs its input for the weight gradient).
        """
        missing = [i for i in self.layer_ids if i not in self.captured]
        if missing:
            raise RuntimeError(f"no output captured for target layers {missing}")
        out = torch.cat([self.captured[i] for i in self.layer_ids], dim=-1)
        self.captured.clear()
        return out

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def pack_documents(docs: list[Tensor], padding: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Token ids of documents -> one packed row: (ids, positions, document ids), each [1, T],
    positions restarting at every document, padding (id 0) with document id -1."""
    ids = torch.cat([*docs, torch.zeros(padding, dtype=torch.long)])
    positions = torch.cat([torch.arange(len(d)) for d in docs] + [torch.arange(padding)])
    doc_ids = torch.cat(
        [torch.full((len(d),), i) for i, d in enumerate(docs)] + [torch.full((padding,), -1)]
    )
    return ids[None], positions[None], doc_ids[None]


def tap_errors(got: Tensor, ref: Tensor, taps: LayerTaps) -> list[float]:
    """Per tapped layer, ||got - ref|| / ||ref|| over a document's taps [n, K*H]."""
    width = ref.shape[-1] // len(taps.layer_ids)
    errors = []
    for k in range(len(taps.layer_ids)):
        a, b = got[:, k * width : (k + 1) * width].float(), ref[:, k * width : (k + 1) * width]
        errors.append(float((a - b.float()).norm() / b.float().norm().clamp_min(1e-30)))
    return errors


@dataclass(slots=True)
class TargetOutputs:
    """What the target gives the drafter for a packed row (R rows, k = soft_top_k)."""

    features: Tensor  # [R, T, K*H] the taps, concatenated
    next_tokens: Tensor | None  # [R, ...] argmax at the label positions (the hard labels)
    soft_ids: Tensor | None = None  # [R, ..., k] the target's top-k tokens there
    soft_probs: Tensor | None = None  # [R, ..., k] fp32, their probabilities (sum 1 over k)


class Target:
    """A frozen target with its taps, its head, and the packed forward the trainer needs."""

    def __init__(
        self,
        model: Any,
        layer_ids: list[int],
        backend: Backend,
        sharded: bool = False,
        linear_kernels: VarlenKernels | Literal["auto", "per-document"] = "auto",
    ) -> None:
        """`linear_kernels` (hybrid targets only): how the linear-attention layers keep packed
        documents apart; "auto" = fla's varlen kernels on CUDA when they import, else each
        document through the layer alone ("per-document")."""
        self.model = model
        # FSDP2 all-gathers into buffers that inference mode would mark read-only.
        self.no_grad = torch.no_grad if sharded else torch.inference_mode
        self.config = model.config.get_text_config()
        self.base = base_model(model)
        self.head = TargetHead.from_model(model)
        self.taps = LayerTaps(model, layer_ids)
        self.backend = mask_backend(model, backend)
        # Loaded with the varlen attention (`target.attn_implementation = "varlen"`): packed
        # rows go through the flash kernel with their document boundaries, no mask.
        self.varlen = getattr(model.config, "_attn_implementation", None) == varlen.NAME
        if self.varlen and (why := varlen.refusal(self.config)) is not None:
            raise ValueError(
                f'target.attn_implementation = "varlen": not for this target, {why}; leave it '
                "unset (flex_attention on CUDA)"
            )
        self._no_mask = varlen.NO_MASK.to(self.device) if self.varlen else None
        self.num_layers = len(decoder_layers(model))
        self.linear: PackedLinearAttention | None = None
        if is_hybrid(self.config):
            self.pack_linear_layers(linear_kernels)

    def pack_linear_layers(self, choice: VarlenKernels | Literal["auto", "per-document"]) -> None:
        """(Re)install the exact packed path on a hybrid target's linear-attention layers and
        say once which one runs (benchmarks compare the two)."""
        if self.linear is not None:
            self.linear.remove()
        why = "chosen"
        if choice == "auto":
            kernels, why = choose_kernels(self.device)
        else:
            kernels = None if choice == "per-document" else choice
        linear = PackedLinearAttention(decoder_layers(self.model), self.config, kernels)
        count = f"{len(linear_layer_ids(self.config))} of {self.num_layers} target layers"
        if kernels is not None:
            log.info(f"hybrid target: {count} are linear attention; packed documents restart "
                     f"there through {kernels.name}'s varlen kernels")  # fmt: skip
        else:
            say = log.warning if self.device.type == "cuda" else log.info
            say(f"hybrid target: {count} are linear attention; packed documents run through "
                f"them one at a time (per-document fallback, exact but slower: {why})")  # fmt: skip
        self.linear = linear

    @property
    def device(self) -> torch.device:
        return self.head.weight.device

    def verify_taps(self, length: int = 24) -> None:
        """Start-up check: hook taps == hidden_states[i + 1] of an HF reference forward.

        For the last layer HF reports the final-normed state, so there the check is
        final_norm(tap) == hidden_states[L]. Raises ValueError on any mismatch.
        """
        gen = torch.Generator().manual_seed(0)
        vocab = self.head.vocab_size
        ids = torch.randint(0, vocab, (1, length), generator=gen).to(self.device)
        with self.no_grad():
            out = self.model(input_ids=ids, output_hidden_states=True, use_cache=False)
            taps = dict(self.taps.captured)
            self.taps.captured.clear()
            hidden = out.hidden_states
            if len(hidden) != self.num_layers + 1:
                raise ValueError(
                    f"target returned {len(hidden)} hidden states for {self.num_layers} layers"
                )
            norm = getattr(base_model(self.model), "norm", None)  # self.base may be compiled
            for i in self.taps.layer_ids:
                tap = taps.get(i)
                reference = hidden[i + 1]
                if tap is None:
                    raise ValueError(f"forward hook on target layer {i} captured nothing")
                if i == self.num_layers - 1 and norm is not None:
                    tap = norm(tap)
                if tap.shape != reference.shape or not torch.allclose(
                    tap.float(), reference.float(), rtol=1e-3, atol=1e-3
                ):
                    raise ValueError(
                        f"tap of target layer {i} differs from hidden_states[{i + 1}] of a "
                        "reference forward: the layer-id convention or the hook is wrong "
                        "(ids must be 0-based decoder-layer outputs, z-lab convention)"
                    )
        if self.linear is not None:
            self.verify_packing()

    def verify_packing(self, lengths: tuple[int, ...] = (21, 14), padding: int = 5) -> None:
        """Start-up check for hybrid targets (docs/design.md §3): a packed row of documents (+ padding)
        gives the taps and next-token labels of each document run alone through the model's
        own forward (with the packed row's expert routing, for MoE targets): the first
        document within `PATH_TOLERANCE` (nothing precedes it: the kernels' rounding), each
        later one within twice the first one's error plus `PACKING_TOLERANCE` of the target
        dtype (what more there is came from the documents before it), over the whole
        document and, held to the same rule, over its first `conv_window` tokens alone: a
        convolution state crossing a document start reaches those tokens directly, and over
        the whole document its share is diluted below the bf16 tolerance (tests). A label
        may differ only where the document's own logits tie within the tolerance. Raises
        ValueError otherwise."""
        gen = torch.Generator().manual_seed(1)
        docs = [torch.randint(0, self.head.vocab_size, (n,), generator=gen) for n in lengths]
        ids, positions, doc_ids = (t.to(self.device) for t in pack_documents(docs, padding))
        every = torch.arange(ids.shape[1], device=self.device)[None]
        # MoE targets: each document alone takes the packed row's expert choices, so that a
        # bf16 near-tie flipping a route does not pass for a leak (`flashdraft.model.routing`).
        routing = PinnedRouting(self.model)
        with routing.record():
            out = self.packed_outputs(ids, positions, doc_ids, every)
        features, labels = out.features, out.next_tokens
        assert labels is not None
        dtype = self.head.weight.dtype
        tolerance = PACKING_TOLERANCE.get(dtype, 1e-2)
        path_tolerance = PATH_TOLERANCE.get(dtype, 0.1)
        if precision_of(self.model) == "fp8":
            path_tolerance *= FP8_PATH_GAIN
        path = self.linear.path if self.linear is not None else "attention mask only"
        window = conv_window(self.config)
        # Per part of a document and tapped layer: the first document's errors.
        whole, head = "the whole document", f"its first {window} tokens"
        floor = {part: [0.0] * len(self.taps.layer_ids) for part in (whole, head)}
        start = 0
        for d, doc in enumerate(docs):
            span = slice(start, start + len(doc))
            start += len(doc)
            with routing.replay(span.start, span.stop):
                taps, alone_labels, logits = self._document_alone(doc.to(self.device))
            got = features[0, span]
            measured = {whole: tap_errors(got, taps, self.taps)}
            if window:
                measured[head] = tap_errors(got[:window], taps[:window], self.taps)
            errors = measured[whole]
            for k, (layer, error) in enumerate(zip(self.taps.layer_ids, errors, strict=True)):
                if d == 0 and error > path_tolerance:
                    raise ValueError(
                        f"hybrid target: the tap of layer {layer} in a packed row differs from "
                        f"document 0 run alone by {error:.2g} (relative; tolerance "
                        f"{path_tolerance:g}); nothing precedes the first "
                        f"document, so the packed forward (packed path: {path}) is not the "
                        "model's own; refusing to train on features the target never produces"
                    )
                for part, part_errors in measured.items():
                    if d > 0 and part_errors[k] > tolerance + 2 * floor[part][k]:
                        raise ValueError(
                            f"hybrid target: the tap of layer {layer} in a packed row differs "
                            f"from document {d} run alone by {part_errors[k]:.2g} over "
                            f"{part} (relative; tolerance {tolerance:g} + twice the first "
                            f"document's {floor[part][k]:.2g}): packed documents leak into "
                            "each other through the linear-attention layers (packed path: "
                            f"{path}); refusing to train on features the target never produces"
                        )
            log.info(
                f"hybrid target: packing check, document {d}: tap errors "
                + ", ".join(f"{e:.2g}" for e in errors)
                + (f"; first {window} tokens " + ", ".join(f"{e:.2g}" for e in measured[head])
                   if window else "")
            )  # fmt: skip
            # A label may differ only where the document's own top logits tie within the
            # tolerance its taps are held to.
            near = path_tolerance if d == 0 else tolerance + 2 * max(floor[whole])
            if d == 0:
                floor.update(measured)  # the rounding the later documents are measured against
            picked_labels = labels[0, span]
            tie = near * float(logits.abs().max())
            picked = logits.gather(1, picked_labels[:, None])[:, 0]
            flips = (picked_labels != alone_labels) & (picked < logits.max(dim=-1).values - tie)
            if bool(flips.any()):
                raise ValueError(
                    f"hybrid target: {int(flips.sum())} next-token labels of document {d} in a "
                    "packed row differ from the document run alone beyond a near-tie (packed "
                    f"path: {path}); refusing to train on wrong labels"
                )

    def _document_alone(self, doc: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The model's own forward of one document [n]: (taps [n, K*H], labels [n], fp32
        logits [n, V]), the labels by the same chunked argmax as `packed_outputs`."""
        with self.no_grad():
            last = self.base(input_ids=doc[None], use_cache=False).last_hidden_state
            positions = torch.arange(len(doc), device=doc.device)[None]
            # one chunk shape for every length: on CUDA the chunks run compiled, padded
            labels = self.head.argmax_at(last, positions, DOCUMENT_CHUNK_ROWS)[0]
            logits = self.head.logits(last[0])
        return self.taps.features()[0], labels, logits

    def packed_outputs(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        doc_ids: Tensor,
        label_positions: Tensor | None,
        chunk_rows: int = 4096,
        soft_top_k: int = 0,
        segments: varlen.Segments | None = None,
        label_index: Tensor | None = None,
    ) -> TargetOutputs:
        """One packed forward: the taps, and at label_positions [R, ...] (packed indices) the
        argmax next tokens and, when `soft_top_k` > 0, the top-k soft labels
        (`TargetHead.labels_at`). With `label_index` [R, ...], label_positions [1, N] are
        indices into all R rows' tokens, each computed once, and the labels are theirs at
        label_index (`flashdraft.train.features.label_plan`: overlapping blocks). The labels are computed only there, in chunks, from the
        final-normed last hidden state (never the full [R, T, V] logits).
        Per-document positions and a per-document causal mask make each document's taps
        identical to running it alone. A varlen target takes the documents' boundaries
        instead of a mask: `segments` (`varlen.document_segments` of the rows' CPU doc ids,
        so that no host sync waits for the device), else computed here from `doc_ids`.
        """
        packing: AbstractContextManager[None] = nullcontext()
        if self.varlen:
            mask: Any = self._no_mask
            segments = segments or varlen.document_segments(doc_ids)
            packing = varlen.packed(segments.to(self.device))
        else:
            mask = build_document_mask(doc_ids, self.backend)
        linear: AbstractContextManager[None] = nullcontext()
        if self.linear is not None:  # hybrid: the linear layers restart at document starts
            mask = attention_masks(self.config, mask)
            linear = self.linear.packed(doc_ids)
        labels: tuple[Tensor | None, ...] = (None, None, None)
        with self.no_grad(), packing, linear:
            out = self.base(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=mask,
                use_cache=False,
            )
            if label_positions is not None:
                last = out.last_hidden_state
                if label_index is not None:  # over the rows' tokens as one sequence
                    last = last.reshape(1, -1, last.shape[-1])
                labels = self.head.labels_at(last, label_positions, chunk_rows, soft_top_k)
                if label_index is not None:
                    labels = tuple(
                        t if t is None else t.reshape(-1, *t.shape[2:])[label_index] for t in labels
                    )
        features = self.taps.features()  # outside inference mode: an ordinary tensor
        # Clones leave inference mode too: autograd may then use them like any tensor.
        next_tokens, soft_ids, soft_probs = (t if t is None else t.clone() for t in labels)
        return TargetOutputs(features, next_tokens, soft_ids, soft_probs)

    def flops_per_token(self, context_len: int) -> float:
        """Forward FLOPs per token of the decoder stack (the LM head runs only at label
        positions and is counted there): (1) 2 x parameters of the stack without the
        embedding; (2) attention scores and weighted sum in the full/sliding attention layers
        only (linear-attention layers have none), 4 x q_dim x keys seen (~half the context,
        causal) per layer; (3) the gated delta rule of the linear-attention layers, which no
        parameter count covers (`hybrid.delta_rule_flops_per_token`)."""
        config = self.config
        params = sum(p.numel() for p in self.base.parameters())
        params -= sum(p.numel() for p in self.head.embedding.parameters())
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        attention_layers = config.num_hidden_layers - len(linear_layer_ids(config))
        attention = 4 * attention_layers * heads * head_dim * context_len / 2
        return 2 * params + attention + delta_rule_flops_per_token(config)
