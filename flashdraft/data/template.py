"""Chat-template rendering and assistant loss masks by prefix rendering (docs/design.md §7).

What is trained. For every trained assistant turn, exactly the text the template emits after
that turn's generation prompt, up to and including the end-of-turn token: the think block
when reasoning is kept, the content, tool calls, and the end-of-turn token (`<|im_end|>`),
but not the whitespace the template adds after it. Everything else is 0: system, user and
tool turns, every generation prompt (`<|im_start|>assistant\\n`), and an *empty* reasoning
block that the template inserts when a turn has no reasoning (Qwen3's
`<think>\\n\\n</think>\\n\\n`) — a drafter must not learn boilerplate the target is handed.

How spans are found. Only with the tokenizer's own template, never by string surgery:
render the conversation up to a turn with the generation prompt (P) and with the turn (F);
F must start with P (else the template has no usable assistant marker and the record is
rejected), and the turn's text is F[len(P):] without trailing whitespace. Whether text
before the content is an empty reasoning block is also asked of the template: rendering the
turn with a probe reasoning must give the same text plus the probe. The full text is then
tokenized once with offsets, and a token is trained iff it starts inside a trained span.

This module is the reference: every turn is rendered in its full context, O(turns²) template
calls per conversation. `template_fast.FastChatTemplate` gives the same samples with far
fewer calls (what `prepare` uses); tests check the two agree on real chats.

Templates that rewrite earlier turns. Qwen3 drops the reasoning of assistant turns before
the last user query, so the full rendering does not contain the think block those turns
had when they were generated. Policy: a turn is trained in the full-conversation sample
only if its exact trained text appears there; otherwise it gets its own sample, the
conversation rendered up to and including that turn (as the target saw it when it
generated the turn), in which only that turn is trained. With reasoning kept, a Qwen3 chat
of n question-answer rounds with reasoning becomes n samples; without reasoning it is one.
Each turn is trained exactly once. The context before a turn may differ from the prompt of
that turn only in untrained template text (Qwen3 renders no empty think block in history).

Thinking options: `keep` trains the reasoning inside the think block; `strip` drops the
reasoning and keeps the answer; `off` also renders with `enable_thinking=False` (the
template's non-thinking mode, where it has one).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from jinja2 import TemplateError
from transformers import AutoTokenizer
from transformers.utils.chat_template_utils import render_jinja_template

from flashdraft import config as cfg
from flashdraft.config import option
from flashdraft.data.formats import Conversation, Message, RecordError

# Private-use code points: never produced by a template, rare in data, and refused in
# messages (`ChatTemplate.messages`). The reference probes with PROBE; the fast path also
# marks assistant contents (CONTENT_OPEN, CONTENT_CLOSE) and reasoning (REASONING_PROBE).
CONTENT_OPEN, CONTENT_CLOSE, PROBE, REASONING_PROBE = "\ue000", "\ue001", "\ue002", "\ue003"
MARKERS = re.compile(f"[{CONTENT_OPEN}{CONTENT_CLOSE}{PROBE}{REASONING_PROBE}]")

# What a misbehaving template raises on one record (jinja's raise_exception, a missing field).
_TEMPLATE_ERRORS: tuple[type[Exception], ...] = (
    TemplateError,
    TypeError,
    ValueError,
    KeyError,
    AttributeError,
    IndexError,
)

# Both options decide the data: `prepare` compares them on resume ("data") and records them
# in its manifest ("manifest").
_RECORDED = ("data", "manifest")


@dataclass(kw_only=True, slots=True)
class TemplateOptions:
    thinking: Literal["keep", "strip", "off"] = option(
        "keep",
        help="keep: train reasoning; strip: drop it; off: render in the template's "
        "non-thinking mode",
        tags=_RECORDED,
    )
    turns: Literal["all", "last"] = option(
        "all", help="train every assistant turn or only the last", tags=_RECORDED
    )

    def __post_init__(self) -> None:
        cfg.validate(self)


@dataclass(slots=True)
class RenderedSample:
    """One training sample as text: `spans` are the trained character ranges, sorted."""

    text: str
    spans: list[tuple[int, int]]
    turn: int  # message index of the last trained turn; names split samples


@dataclass(slots=True)
class Turn:
    """An assistant turn rendered as the last message of `text`."""

    text: str
    start: int  # trained span [start, end) in text
    end: int
    content: int  # where the turn's content starts in text

    def sample(self, turn: int) -> RenderedSample:
        """This turn alone as a training sample, ending with its last trained token."""
        return RenderedSample(text=self.text[: self.end], spans=[(self.start, self.end)], turn=turn)


# Where a trained turn is in the full conversation's text: its span, or, when the full text
# does not hold it (a template that rewrites earlier turns), the turn rendered on its own.
Located = tuple[int, int] | Turn


def load_tokenizer(path: str | Path) -> Any:
    """A fast (Rust) tokenizer with a chat template; ValueError naming what is missing."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path))
    except OSError as err:
        raise FileNotFoundError(f"cannot load a tokenizer from {str(path)!r}: {err}") from None
    if not getattr(tokenizer, "is_fast", False):
        raise ValueError(
            f"tokenizer {str(path)!r} is not a fast tokenizer; loss masks need its character offsets"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"tokenizer {str(path)!r} has no chat template; loss masks come from the template"
        )
    return tokenizer


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of everything that decides the tokens: vocabulary/merges, template, specials."""
    digest = hashlib.sha256()
    digest.update(tokenizer.backend_tokenizer.to_str().encode())
    template = tokenizer.chat_template
    digest.update(
        str(sorted(template.items()) if isinstance(template, dict) else template).encode()
    )
    digest.update(repr(sorted(tokenizer.special_tokens_map.items())).encode())
    return digest.hexdigest()


class ChatTemplate:
    """Renders conversations with a tokenizer's chat template and finds what to train."""

    def __init__(self, tokenizer: Any, options: TemplateOptions) -> None:
        self.tokenizer = tokenizer
        self.options = options
        self._kwargs: dict[str, Any] = dict(tokenizer.special_tokens_map)
        if options.thinking == "off":
            self._kwargs["enable_thinking"] = False
        specials = sorted(
            (t.content for t in tokenizer.added_tokens_decoder.values() if t.special),
            key=len,
            reverse=True,
        )
        self._specials = re.compile("|".join(map(re.escape, specials))) if specials else None

    # -- rendering -------------------------------------------------------------------------

    def render(
        self,
        messages: Sequence[dict[str, Any]],
        *,
        generation_prompt: bool = False,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The template's text, exactly as `apply_chat_template(tokenize=False)` renders it."""
        # The same renderer apply_chat_template calls, without its per-call tokenizer
        # bookkeeping: this runs a few times per assistant turn.
        schemas: Any = tools
        try:
            result: Any = render_jinja_template(
                conversations=[list(messages)],
                tools=schemas,
                chat_template=self.tokenizer.get_chat_template(None, tools),
                add_generation_prompt=generation_prompt,
                **self._kwargs,
            )
        except _TEMPLATE_ERRORS as err:
            raise RecordError(f"chat template failed: {err}") from None
        return str(result[0][0])

    def messages(self, conversation: Conversation) -> list[dict[str, Any]]:
        """Template inputs with the thinking option applied; RecordError for unusable text."""
        keep = self.options.thinking == "keep"
        out = []
        for i, message in enumerate(conversation):
            reasoning = message.reasoning if keep and (message.reasoning or "").strip() else None
            for text in (message.content, reasoning or ""):
                if MARKERS.search(text):
                    raise RecordError(f"message {i} contains a private-use marker character")
                found = self._specials.search(text) if self._specials else None
                if found:
                    raise RecordError(
                        f"message {i} contains the special token {found.group()!r} as text"
                    )
            data = {"role": message.role, "content": message.content}
            data.update((k, v) for k, v in message.extra.items() if v is not None)
            if reasoning is not None:
                data["reasoning_content"] = reasoning
            if (
                message.role == "assistant"
                and not message.content.strip()
                and reasoning is None
                and not data.get("tool_calls")
            ):
                raise RecordError(
                    f"assistant turn {i} is empty once its reasoning is dropped "
                    f"(--thinking {self.options.thinking})"
                )
            out.append(data)
        return out

    # -- samples ---------------------------------------------------------------------------

    def samples(
        self, conversation: Conversation, tools: list[dict[str, Any]] | None = None
    ) -> list[RenderedSample]:
        """The training samples of one conversation (see the module docstring for policy)."""
        messages = self.messages(conversation)  # one per message, in order
        assistant = [
            i
            for i, (m, turn) in enumerate(zip(messages, conversation, strict=True))
            if m["role"] == "assistant" and turn.trained
        ]
        if not assistant:
            raise RecordError("conversation has no assistant turn to learn from")
        trained = assistant if self.options.turns == "all" else assistant[-1:]
        last = trained[-1]
        messages = messages[: last + 1]
        if len(trained) == 1:
            return [self._turn(messages[:last], messages[last], tools).sample(last)]

        text = self.render(messages, tools=tools)
        locate = self._locator(messages, text, tools)
        spans: list[tuple[int, int]] = []
        samples: list[RenderedSample] = []
        for i in trained:
            found = locate(i)
            if isinstance(found, Turn):  # rewritten in the full text: a sample of its own
                samples.append(found.sample(i))
            elif spans and found[0] < spans[-1][1]:
                raise RecordError("the chat template renders assistant turns out of order")
            else:
                spans.append(found)
                kept = i
        if spans:
            samples.append(RenderedSample(text=text[: spans[-1][1]], spans=spans, turn=kept))
        return samples

    def _locator(
        self,
        messages: list[dict[str, Any]],
        text: str,
        tools: list[dict[str, Any]] | None,
    ) -> Callable[[int], Located]:
        """Message index -> where that trained turn is in `text`, the full rendering.

        The reference: the turn rendered in its full context (prefix rendering), then found
        at its place in `text` (`_find`).
        """

        def locate(index: int) -> Located:
            full = self._turn(messages[:index], messages[index], tools)
            span = self._find(text, messages[:index], full, tools)
            return full if span is None else span

        return locate

    def _find(
        self,
        text: str,
        context: list[dict[str, Any]],
        turn: Turn,
        tools: list[dict[str, Any]] | None,
    ) -> tuple[int, int] | None:
        """The trained text of `turn` in `text` at its place, found without content markers.

        Its place: `text` must start with the rendering of the turn's context, and the
        trained text must follow within the length of the turn's own prompt header (the
        full text may omit untrained scaffolding there, as Qwen3 omits empty think blocks
        of earlier turns).
        """
        if text.startswith(turn.text[: turn.end]):
            return turn.start, turn.end
        history = self.render(context, tools=tools)
        trained = turn.text[turn.start : turn.end]
        if not text.startswith(history):
            return None
        at = text.find(trained, len(history), turn.start + len(trained))
        return None if at < 0 else (at, at + len(trained))

    def _turn(
        self,
        context: list[dict[str, Any]],
        message: dict[str, Any],
        tools: list[dict[str, Any]] | None,
        prompt: str | None = None,
    ) -> Turn:
        """Render `context + [message]` and find the trained span of `message` in it
        (`prompt`: the rendering of `context` with the generation prompt, if known)."""
        if prompt is None:
            prompt = self.render(context, generation_prompt=True, tools=tools)
        text = self.render([*context, message], tools=tools)
        if not text.startswith(prompt):
            raise RecordError(
                f"chat template: the rendering of assistant turn {len(context)} does not start "
                "with the rendering of its prompt (add_generation_prompt=True), so its tokens "
                "cannot be told apart"
            )
        body = text[len(prompt) :]
        end = len(body.rstrip())
        reasoning = message.get("reasoning_content")
        if reasoning is not None and reasoning.strip() not in body:
            raise RecordError(
                "the chat template does not render the assistant's reasoning; "
                "use --thinking strip (or a template that renders reasoning_content)"
            )
        for call in message.get("tool_calls") or []:
            name = (call.get("function") or call).get("name") if isinstance(call, dict) else None
            if isinstance(name, str) and name not in body:
                raise RecordError(
                    f"the chat template does not render the tool call to {name!r} of "
                    f"assistant turn {len(context)}"
                )
        content = self._content_offset(context, message, prompt, body, tools)
        start = 0
        if reasoning is None and self._is_empty_reasoning(
            context, message, prompt, body, content, tools
        ):
            start = content
        if end <= start:
            raise RecordError(f"assistant turn {len(context)} renders no text to train")
        base = len(prompt)
        return Turn(text=text, start=base + start, end=base + end, content=base + content)

    def _content_offset(
        self,
        context: list[dict[str, Any]],
        message: dict[str, Any],
        prompt: str,
        body: str,
        tools: list[dict[str, Any]] | None,
    ) -> int:
        """Where the message's content starts in the turn's rendering `body`."""
        content = message["content"].strip()
        if content and body.count(content) == 1:
            return body.index(content)
        # Empty or repeated content: ask the template with a probe content instead.
        text = self.render([*context, {**message, "content": PROBE}], tools=tools)
        at = text.find(PROBE, len(prompt))
        if at < 0 or not text.startswith(prompt):
            raise RecordError(f"the chat template does not render assistant turn {len(context)}")
        return at - len(prompt)

    def _is_empty_reasoning(
        self,
        context: list[dict[str, Any]],
        message: dict[str, Any],
        prompt: str,
        body: str,
        content: int,
        tools: list[dict[str, Any]] | None,
    ) -> bool:
        """Is the text before the content the template's reasoning block with no reasoning?

        It is iff rendering the turn with a probe reasoning gives the same text plus the
        probe, placed before the content.
        """
        if not body[:content].strip():
            return False
        text = self.render([*context, {**message, "reasoning_content": PROBE}], tools=tools)
        probed = text[len(prompt) :]
        at = probed.find(PROBE)
        return (
            text.startswith(prompt) and 0 <= at <= content and probed.replace(PROBE, "", 1) == body
        )

    # -- run-level check -------------------------------------------------------------------

    def check(self) -> None:
        """Refuse a template whose assistant turns cannot be told apart (docs/design.md §8 trap 8).

        Raises ValueError with the reason; run once before any data is processed.
        """
        conversation = [
            Message("system", "You are a careful assistant."),
            Message("user", "What is the capital of France?"),
            Message("assistant", "The capital of France is Paris."),
            Message("user", "And of Italy?"),
            Message("assistant", "The capital of Italy is Rome."),
        ]
        messages = self.messages(conversation)
        name = getattr(self.tokenizer, "name_or_path", "the tokenizer")
        try:
            history = self.render(messages[:2])
            prompt = self.render(messages[:2], generation_prompt=True)
            with_turn = self.render(messages[:3])
            samples = self.samples(conversation)
        except RecordError as err:
            raise ValueError(
                f"the chat template of {name} cannot render a plain chat: {err}"
            ) from None
        if prompt == history:
            raise ValueError(
                f"the chat template of {name} adds nothing for add_generation_prompt=True, so it "
                "has no assistant marker: assistant tokens cannot be told apart from the prompt "
                "(a mask from it would train role headers or everything). Use a chat model's "
                "tokenizer or add a generation prompt to the template."
            )
        if not with_turn.startswith(prompt):
            raise ValueError(
                f"the chat template of {name} renders an assistant turn that does not start with "
                "its own generation prompt, so assistant tokens cannot be located"
            )
        trained = "".join(sample.text[a:b] for sample in samples for a, b in sample.spans)
        untrained = "".join(_untrained(sample) for sample in samples)
        learn = [m for m in conversation if m.role == "assistant"]
        learn = learn if self.options.turns == "all" else learn[-1:]
        others = [m.content for m in conversation if all(m is not x for x in learn)]
        if not all(m.content in trained for m in learn) or any(o in trained for o in others):
            raise ValueError(
                f"the chat template of {name} does not separate assistant turns from the rest "
                f"of the conversation; the trained text would be {trained!r}"
            )
        if not all(o in untrained for o in others):
            raise ValueError(f"the chat template of {name} drops messages from its rendering")


def _untrained(sample: RenderedSample) -> str:
    bounds = [0, *(x for span in sample.spans for x in span), len(sample.text)]
    return "".join(sample.text[a:b] for a, b in zip(bounds[::2], bounds[1::2], strict=True))


# -- tokens ----------------------------------------------------------------------------------


def encode(
    tokenizer: Any, samples: Sequence[RenderedSample]
) -> list[tuple[np.ndarray, np.ndarray] | RecordError]:
    """(input_ids int32, loss_mask int8) per sample, or why it is unusable.

    One batched tokenization with character offsets. A token is trained iff its first
    character lies in a trained span; a token that straddles the start of a span holds
    prompt text and stays 0.
    """
    encodings = tokenizer.backend_tokenizer.encode_batch(
        [s.text for s in samples], add_special_tokens=False
    )
    out: list[tuple[np.ndarray, np.ndarray] | RecordError] = []
    for sample, encoding in zip(samples, encodings, strict=True):
        ids = np.asarray(encoding.ids, dtype=np.int32)
        starts = np.fromiter((o[0] for o in encoding.offsets), dtype=np.int64, count=len(ids))
        mask = np.zeros(len(ids), dtype=np.int8)
        bounds = np.searchsorted(starts, np.asarray(sample.spans, dtype=np.int64).ravel())
        for lo, hi in bounds.reshape(-1, 2):
            mask[lo:hi] = 1
        if np.any(bounds[1::2] <= bounds[::2]):
            out.append(RecordError("an assistant turn tokenizes to no tokens"))
        elif mask.all():
            out.append(
                RecordError(
                    "every token would be trained (all-ones loss mask): the template does not "
                    "mark where assistant turns start"
                )
            )
        else:
            out.append((ids, mask))
    return out
