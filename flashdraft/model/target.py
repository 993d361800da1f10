"""The frozen target: loading, layer taps by forward hooks, the packed forward, labels.

Shape legend: R rows, T tokens per packed row, K tapped layers, H hidden, V vocabulary,
N label positions.

Taps follow the z-lab convention (SPEC section 3): id i is the *output of decoder layer i*,
i.e. `hidden_states[i + 1]` of an HF forward with `output_hidden_states=True`. They are
captured with forward hooks on the decoder layers, never with `output_hidden_states` (which
keeps every layer alive), and never from `hidden_states[-1]`, which HF replaces by the
final-normed state. `Target.verify_taps` checks all of this at start-up.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from flashdraft.model.attention import Backend, build_document_mask
from flashdraft.model.head import TargetHead

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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
) -> nn.Module:
    """A frozen HF causal LM in eval mode. Never trusts remote code."""
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPES:
        raise ValueError(f"target dtype {dtype!r} is not one of {sorted(DTYPES)}")
    model: Any = AutoModelForCausalLM.from_pretrained(
        path,
        dtype=DTYPES[dtype],
        attn_implementation=attn_implementation,
        trust_remote_code=False,
    )
    model.eval().requires_grad_(False)
    return model.to(device)


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


class Target:
    """A frozen target with its taps, its head, and the packed forward the trainer needs."""

    def __init__(
        self, model: Any, layer_ids: list[int], backend: Backend, sharded: bool = False
    ) -> None:
        self.model = model
        # FSDP2 all-gathers into buffers that inference mode would mark read-only.
        self.no_grad = torch.no_grad if sharded else torch.inference_mode
        self.config = model.config.get_text_config()
        self.base = base_model(model)
        self.head = TargetHead.from_model(model)
        self.taps = LayerTaps(model, layer_ids)
        self.backend = backend
        self.num_layers = len(decoder_layers(model))

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
            norm = getattr(self.base, "norm", None)
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

    def forward_packed(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        doc_ids: Tensor,
        label_positions: Tensor | None,
        chunk_rows: int = 4096,
    ) -> tuple[Tensor, Tensor | None]:
        """One packed forward: (taps [R, T, K*H], argmax next tokens at label_positions).

        label_positions [R, ...] are packed indices; the argmax is computed only there, in
        chunks, from the final-normed last hidden state (never the full [R, T, V] logits).
        Per-document positions and a per-document causal mask make each document's taps
        identical to running it alone.
        """
        mask = build_document_mask(doc_ids, self.backend)
        with self.no_grad():
            out = self.base(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=mask,
                use_cache=False,
            )
            next_tokens = None
            if label_positions is not None:
                next_tokens = self.head.argmax_at(
                    out.last_hidden_state, label_positions, chunk_rows
                )
        features = self.taps.features()  # outside inference mode: an ordinary tensor
        if next_tokens is not None:
            next_tokens = next_tokens.clone()
        return features, next_tokens

    def flops_per_token(self, context_len: int) -> float:
        """Forward FLOPs per token of the decoder stack (the LM head runs only at label
        positions and is counted there): (1) 2 x parameters of the stack without the
        embedding; (2) attention scores and weighted sum, 4 x layers x q_dim x keys seen
        (~half the context, causal)."""
        config = self.config
        params = sum(p.numel() for p in self.base.parameters())
        params -= sum(p.numel() for p in self.head.embedding.parameters())
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        attention = 4 * config.num_hidden_layers * heads * head_dim * context_len / 2
        return 2 * params + attention
