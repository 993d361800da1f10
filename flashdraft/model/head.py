"""The target's frozen input embedding and output head, shared with the drafter (docs/design.md §2).

The drafter owns neither: block tokens are embedded with the target's table and drafter
hidden states go through the target's LM head (with the target's logit scaling / softcap, if
it has any). Holding references here keeps them out of the drafter's state dict and optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from flashdraft.model.config import DrafterConfig, logit_scaling_of


def scaled_logits(z: Tensor, scale: float, softcap: float | None) -> Tensor:
    """Raw `h @ W^T` -> the target's logits (scale, then softcap), in z's dtype."""
    if scale != 1.0:
        z = z * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return z


def label_chunk(
    z: Tensor, scale: float, softcap: float | None, top_k: int
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The labels of one chunk of z = h @ W^T [n, V]: (argmax [n], and when `top_k` > 0 the
    top-k ids [n, k] with their softmax over those k in fp32, else None, None). A pure
    function, so that CUDA runs it compiled (`_LABEL_CHUNK`): one read of z for the argmax
    (eager argmax over 49,152 bf16 logits ran at ~0.9 TB/s, 3.6 ms of an 8-row SmolLM2 step
    on an H200, profiled)."""
    logits = scaled_logits(z, scale, softcap)
    argmax = logits.argmax(dim=-1)
    if not top_k:
        return argmax, None, None
    values, ids = logits.topk(top_k, dim=-1)
    return argmax, ids, values.float().softmax(dim=-1)


# One graph per chunk shape and head (the rows are padded to whole chunks). Rounded as eager
# rounds (`emulate_precision_casts`): a scaled or capped target's bf16 logits, and so its
# argmax at near-ties, are the eager ones.
LABEL_CHUNK_OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {
    "emulate_precision_casts": True
}
_LABEL_CHUNK = torch.compile(label_chunk, dynamic=False, options=LABEL_CHUNK_OPTIONS)


@dataclass(slots=True)
class TargetHead:
    embedding: nn.Module  # the target's input embedding module (may scale, e.g. Gemma)
    weight: Tensor  # [V, H] LM-head weight, frozen
    logit_scale: float = 1.0  # multiply logits (Cohere `logit_scale`; Granite 1/`logits_scaling`)
    softcap: float | None = None  # final_logit_softcapping (Gemma 2/3)

    @classmethod
    def from_model(cls, model: Any) -> TargetHead:
        """From an HF causal LM; references its modules, copies nothing."""
        return cls.from_parts(
            model.get_input_embeddings(),
            model.get_output_embeddings().weight,
            model.config.get_text_config(),
        )

    @classmethod
    def from_parts(cls, embedding: nn.Module, weight: Tensor, text_config: Any) -> TargetHead:
        """From the embedding module, the LM-head weight and the target's text config, which
        says how the target scales and caps its logits."""
        scale, softcap = logit_scaling_of(text_config)
        return cls(embedding=embedding, weight=weight, logit_scale=scale, softcap=softcap)

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    @property
    def input_embedding_scale(self) -> float:
        """What the embedding module multiplies table rows by (transformers'
        `*ScaledWordEmbedding.embed_scale`; 1.0 for a plain table)."""
        return float(getattr(self.embedding, "embed_scale", 1.0))

    def check_drafter(self, config: DrafterConfig) -> None:
        """Refuse a drafter config whose recorded scaling differs from this head's: its export
        would tell the engines to embed or score differently from training (ValueError)."""
        ours = (self.input_embedding_scale, self.logit_scale, self.softcap)
        theirs = (
            config.input_embedding_scale,
            config.output_multiplier,
            config.final_logit_softcapping,
        )
        names = ("input_embedding_scale", "output_multiplier", "final_logit_softcapping")
        wrong = [
            f"{name} {b} (the target's head: {a})"
            for name, a, b in zip(names, ours, theirs, strict=True)
            if (a is None) != (b is None)
            or (a is not None and b is not None and not math.isclose(a, b, rel_tol=1e-6))
        ]
        if wrong:
            raise ValueError(
                "the drafter config records other scaling than the target applies: "
                + "; ".join(wrong)
                + " -- rebuild the drafter config from this target"
            )

    def embed(self, token_ids: Tensor) -> Tensor:
        with torch.no_grad():
            out = self.embedding(token_ids)
        assert isinstance(out, Tensor)
        return out

    def transform(self, logits: Tensor) -> Tensor:
        """Raw `h @ W^T` -> the target's logits (scale, then softcap)."""
        return scaled_logits(logits, self.logit_scale, self.softcap)

    def argmax_at(self, last_hidden: Tensor, positions: Tensor, chunk_rows: int) -> Tensor:
        """argmax of the logits at `positions` [R, ...] of the final-normed last_hidden [R, T, H].

        In chunks of rows, so the full [R, T, V] logits never exist (hard labels, docs/design.md §3).
        """
        return self.labels_at(last_hidden, positions, chunk_rows)[0]

    def labels_at(
        self,
        last_hidden: Tensor,
        positions: Tensor,
        chunk_rows: int,
        top_k: int = 0,
        *,
        compiled: bool | None = None,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(argmax [R, ...], top-k ids [R, ..., k], their probabilities [R, ..., k]) of the
        logits at `positions` [R, ...] of the final-normed last_hidden [R, T, H]; the top-k
        pair only when `top_k` > 0, else (argmax, None, None).

        In chunks of rows, so the full [R, T, V] logits never exist (docs/design.md §3). The
        probabilities are the softmax over the k largest logits, i.e. the target's
        distribution restricted to its top k and renormalised (soft labels: the full
        distribution is V floats per position, 0.6 MB in fp32 for Qwen3's 151,936 tokens,
        4.7 GB for the 7,680 label positions of a row at A = 512, B = 16). They come from
        the logits as the target computes them (the target dtype), softmaxed in fp32.
        `compiled` (default: on CUDA) runs each chunk through `_LABEL_CHUNK`, the rows padded
        to whole chunks so that one graph serves every step.
        """
        rows = positions.shape[0]
        flat = positions.reshape(rows, -1)
        picked = last_hidden.gather(1, flat[..., None].expand(-1, -1, last_hidden.shape[-1]))
        picked = picked.reshape(-1, last_hidden.shape[-1])
        n = picked.shape[0]
        chunk = label_chunk
        if picked.is_cuda if compiled is None else compiled:
            chunk = _LABEL_CHUNK
            if n % chunk_rows:
                picked = F.pad(picked, (0, 0, 0, -n % chunk_rows))
        argmax = torch.empty(picked.shape[0], dtype=torch.long, device=picked.device)
        ids = torch.empty(picked.shape[0], top_k, dtype=torch.long, device=picked.device)
        probs = torch.empty(picked.shape[0], top_k, dtype=torch.float32, device=picked.device)
        weight = self.weight.to(picked.dtype)
        for start in range(0, picked.shape[0], chunk_rows):
            part = slice(start, start + chunk_rows)
            argmax[part], top_ids, top_probs = chunk(
                picked[part] @ weight.T, self.logit_scale, self.softcap, top_k
            )
            if top_ids is not None and top_probs is not None:
                ids[part], probs[part] = top_ids, top_probs
        if not top_k:
            return argmax[:n].view(positions.shape), None, None
        shape = (*positions.shape, top_k)
        return argmax[:n].view(positions.shape), ids[:n].view(shape), probs[:n].view(shape)

    def logits(self, hidden: Tensor) -> Tensor:
        """Full logits [..., V] in fp32. Only for small inputs (decoding, tests)."""
        return self.transform((hidden @ self.weight.to(hidden.dtype).T).float())
