"""`generate --backend openai`: answers from a running OpenAI-compatible server (vLLM, SGLang,
llama.cpp's server, ...) through `/v1/chat/completions`.

Unlike the in-process backends, the server renders each record's messages (and `tools`) with
its own chat template and returns text, not token ids: the answer, its reasoning (the
server's reasoning parser's `reasoning_content` / `reasoning`, else a `<think>` block in the
text) and its `tool_calls` (`Reply`). `generate` writes them in the record format `prepare`
reads, through the same append-only output log as every backend.

The client (`OpenAIClient`) keeps `concurrency` requests in flight on as many threads sharing
one httpx connection pool. A request that fails on a connection error, a timeout,
429 or 5xx is retried up to `max_retries` times with exponential backoff and full jitter
(a server's `Retry-After` is a floor); after the last try it is a `Failure`, which `generate`
writes to `OUT.errors.jsonl` (a re-run tries it again), never dropped. `probe` runs one
request before any work: an unreachable server, an unknown model or a refused key is one
line (`ServerError`), and the server's count of prompt tokens is compared with the
tokenizer `prepare` will use (a drafter trained on one template and served on another loses
acceptance).
"""

from __future__ import annotations

import json
import os
import queue
import random
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

from flashdraft import config as cfg
from flashdraft.config import option
from flashdraft.data.inference import Sampling
from flashdraft.log import get_logger

log = get_logger(__name__)

K = TypeVar("K")

# Statuses worth another try: the server is busy, restarting or overloaded.
RETRY_STATUSES = frozenset({408, 409, 425, 429, 500, 502, 503, 504})
_REASONING_FIELDS = ("reasoning_content", "reasoning")  # vLLM / SGLang / llama.cpp; newer vLLM


class ServerError(RuntimeError):
    """The server cannot serve this run at all (unreachable, unknown model, key refused);
    the message is one line that says what to do."""


@dataclass(kw_only=True, slots=True)
class ServerOptions:
    """`--backend openai`: where the server is and how to talk to it."""

    base_url: str | None = option(
        None, help="--backend openai: the server's URL, e.g. http://localhost:8000/v1"
    )
    model: str | None = option(
        None, help="--backend openai: the served model's name (default: the server's only model)"
    )
    api_key_env: str = option(
        "OPENAI_API_KEY",
        help="--backend openai: the environment variable holding the API key (sent as a "
        "Bearer token when set; never given on the command line)",
    )
    concurrency: int = option(8, ge=1, help="--backend openai: requests in flight at most")
    answers_per_prompt: int = option(
        1,
        ge=1,
        help="--backend openai: answers per prompt (the request's n; answer k > 0 is written "
        "as its own record, id ID~k); needs a temperature above 0",
    )
    request_timeout: float = option(
        600.0, gt=0, help="--backend openai: seconds one request may take before it is retried"
    )
    max_retries: int = option(
        5,
        ge=0,
        help="--backend openai: tries after the first on a connection error, timeout, 429 or "
        "5xx; then the prompt goes to OUT.errors.jsonl (a re-run tries it again)",
    )
    retry_backoff: float = option(
        1.0,
        gt=0,
        help="--backend openai: seconds before the first retry, doubled per retry up to 60, "
        "with full jitter",
    )

    def __post_init__(self) -> None:
        cfg.validate(self)


@dataclass(slots=True)
class Reply:
    """One choice of a chat completion, as `generate` records it."""

    text: str  # the answer (a <think> block inside it when the server parsed none out)
    reasoning: str | None  # the server's parsed reasoning, None when it gave none
    tool_calls: list[dict[str, Any]] | None
    finish_reason: str  # "stop", "length", "tool_calls", ...


@dataclass(slots=True)
class Completion:
    replies: list[Reply]  # one per choice, in `index` order
    prompt_tokens: int | None  # the server's usage counts (None: it gave none)
    completion_tokens: int | None
    retries: int = 0


@dataclass(slots=True)
class Failure:
    error: str  # one line: status and the server's message, or the connection error
    transient: bool  # the server was unreachable or overloaded (not this request's fault)
    retries: int = 0


@dataclass(slots=True)
class _Attempt:
    """One try's outcome: a response body, or an error and whether to try again."""

    body: dict[str, Any] | None = None
    error: str = ""
    retry: bool = False
    wait: float = 0.0  # Retry-After, seconds


def api_root(base_url: str) -> str:
    """`http://host:port` of a base URL given with or without `/v1`."""
    return base_url.rstrip("/").removesuffix("/v1")


def parse_choice(choice: dict[str, Any]) -> Reply:
    message = choice.get("message") or {}
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k)), None)
    return Reply(
        text=message.get("content") or "",
        reasoning=reasoning if isinstance(reasoning, str) else None,
        tool_calls=message.get("tool_calls") or None,
        finish_reason=str(choice.get("finish_reason") or "stop"),
    )


def parse_completion(body: dict[str, Any]) -> Completion:
    choices = sorted(body.get("choices") or [], key=lambda c: int(c.get("index", 0)))
    if not choices:
        raise ValueError("the response has no choices")
    usage = body.get("usage") or {}
    return Completion(
        [parse_choice(c) for c in choices],
        usage.get("prompt_tokens"),
        usage.get("completion_tokens"),
    )


def request_body(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    sampling: Sampling,
    *,
    seed: int,
    n: int = 1,
    thinking: bool | None = None,
    stop_token_ids: list[int] | None = None,
) -> dict[str, Any]:
    """The body of one chat completion request (the client adds `model`).

    Every sampling setting is sent (a server's defaults, e.g. a checkpoint's own top-k,
    would differ from the settings each record carries); top-k only when set, as OpenAI's own
    API has none. `thinking`: the template's `enable_thinking`, where it has the switch (the
    `chat_template_kwargs` of vLLM and SGLang); `stop_token_ids`: extra stop ids (vLLM, SGLang).
    """
    body: dict[str, Any] = {
        "messages": messages,
        "max_tokens": sampling.max_new_tokens,
        "temperature": sampling.temperature,
        "top_p": 1.0 if sampling.greedy else sampling.top_p,
        "seed": seed,
    }
    if sampling.top_k and not sampling.greedy:
        body["top_k"] = sampling.top_k
    if n > 1:
        body["n"] = n
    if tools:
        body["tools"] = tools
    if thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": thinking}
    if stop_token_ids:
        body["stop_token_ids"] = stop_token_ids
    return body


def backoff(attempt: int, base: float, floor: float = 0.0, cap: float = 60.0) -> float:
    """Seconds before retry `attempt` (0-based): full jitter over base * 2^attempt (capped),
    never under the server's Retry-After (`floor`). Jitter spreads the retries of many
    requests that failed together (a restarting server) instead of sending them at once."""
    return max(floor, random.uniform(0, min(cap, base * 2**attempt)))


class OpenAIClient:
    """Chat completions from one server, `options.concurrency` at a time, with retries."""

    def __init__(self, options: ServerOptions, *, sleep: Callable[[float], object] | None = None):
        if not options.base_url:
            raise ValueError("--backend openai needs --base-url (e.g. http://localhost:8000/v1)")
        self.options = options
        self.root = api_root(options.base_url)
        key = os.environ.get(options.api_key_env)
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.http = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(
                options.request_timeout, connect=min(10.0, options.request_timeout)
            ),
            limits=httpx.Limits(max_connections=options.concurrency),
        )
        self.model = options.model or ""
        self._stop = threading.Event()
        # Waits between tries end at once when the run is abandoned (`complete_all`).
        self._sleep = sleep if sleep is not None else self._stop.wait

    def close(self) -> None:
        self._stop.set()  # workers still in a try see it, not a closed client's error
        self.http.close()

    # -- one request ---------------------------------------------------------------------

    def _try(self, body: dict[str, Any]) -> _Attempt:
        abandoned = _Attempt(error="the run was abandoned", retry=False)
        if self._stop.is_set():
            return abandoned
        try:
            response = self.http.post(
                f"{self.root}/v1/chat/completions", json={"model": self.model, **body}
            )
        except httpx.TransportError as err:  # connect, read, timeouts, protocol errors
            return _Attempt(error=f"{type(err).__name__}: {err}".rstrip(": "), retry=True)
        except RuntimeError:  # "the client has been closed": an abandoned run's worker
            if self.http.is_closed:
                return abandoned
            raise
        if response.status_code == 200:
            try:
                return _Attempt(body=response.json())
            except json.JSONDecodeError:
                return _Attempt(error="200 with a body that is not JSON", retry=True)
        retry_after = response.headers.get("retry-after", "")
        return _Attempt(
            error=f"HTTP {response.status_code}: {_server_message(response)}",
            retry=response.status_code in RETRY_STATUSES,
            wait=float(retry_after) if retry_after.replace(".", "", 1).isdigit() else 0.0,
        )

    def complete(self, body: dict[str, Any]) -> Completion | Failure:
        """One chat completion, retried on transient errors; a Failure after the last try."""
        attempt = 0
        while True:
            result = self._try(body)
            if result.body is not None:
                try:
                    completion = parse_completion(result.body)
                except (ValueError, TypeError, AttributeError) as err:
                    return Failure(f"unreadable response: {err}", False, attempt)
                completion.retries = attempt
                return completion
            if not result.retry or attempt >= self.options.max_retries or self._stop.is_set():
                return Failure(result.error, result.retry, attempt)
            self._sleep(backoff(attempt, self.options.retry_backoff, result.wait))
            attempt += 1

    # -- many requests -------------------------------------------------------------------

    def complete_all(
        self, requests: Iterable[tuple[K, dict[str, Any]]]
    ) -> Iterator[tuple[K, Completion | Failure]]:
        """(key, result) for every request, in the order they finish, `concurrency` in flight.

        Requests are taken from `requests` only as slots free up (a lazy input stays lazy).
        Stopping early (the caller breaks, or an interrupt) abandons what is in flight: no new
        tries, and the workers are daemon threads, so a Ctrl-C exits at once instead of
        waiting for answers that may take minutes (a thread pool's workers are joined at exit).
        """
        todo: queue.SimpleQueue[tuple[K, dict[str, Any]] | None] = queue.SimpleQueue()
        done: queue.SimpleQueue[tuple[K, Completion | Failure]] = queue.SimpleQueue()

        def work() -> None:
            while (item := todo.get()) is not None:
                done.put((item[0], self.complete(item[1])))

        workers = [
            threading.Thread(target=work, name=f"openai-{i}", daemon=True)
            for i in range(self.options.concurrency)
        ]
        for worker in workers:
            worker.start()
        source = iter(requests)
        in_flight, exhausted = 0, False
        try:
            while True:
                while not exhausted and in_flight < self.options.concurrency:
                    item = next(source, None)
                    if item is None:
                        exhausted = True
                        break
                    todo.put(item)
                    in_flight += 1
                if not in_flight:
                    return
                key, result = done.get()
                in_flight -= 1
                yield key, result
        finally:
            if in_flight:  # abandoned
                self._stop.set()
            for _ in workers:
                todo.put(None)

    # -- start-up ------------------------------------------------------------------------

    def probe(self, body: dict[str, Any]) -> Completion:
        """Check the server before any work: reachable, serves `model` (or one model, which
        becomes `model`), accepts the key and the request's settings. `body` is one request
        (messages and sampling settings, `max_tokens` small), retried as any other; raises
        ServerError."""
        where = self.options.base_url
        try:
            response = self.http.get(f"{self.root}/v1/models", timeout=30.0)
        except httpx.TransportError as err:
            raise ServerError(
                f"generate: cannot reach {where} ({type(err).__name__}); is the server running "
                "there? (--base-url)"
            ) from None
        if response.status_code in (401, 403):
            raise ServerError(
                f"generate: {where} refused the API key (HTTP {response.status_code}); set "
                f"${self.options.api_key_env} (or name another variable with --api-key-env)"
            )
        served: list[str] = []
        if response.status_code == 200:
            served = [str(m.get("id")) for m in (response.json().get("data") or [])]
        if not self.model:
            if len(served) != 1:
                raise ServerError(
                    f"generate: {where} serves {served or 'no listed model'}; name one with --model"
                )
            self.model = served[0]
        elif served and self.model not in served:
            raise ServerError(
                f"generate: {where} does not serve model {self.model!r} (it serves "
                f"{', '.join(served)}); fix --model"
            )
        result = self.complete(body)
        if isinstance(result, Failure):
            raise ServerError(
                f"generate: the first request to {where} failed ({result.error}); fix the "
                "settings it names or the server, then run again"
            )
        return result


def _server_message(response: httpx.Response) -> str:
    """The error text of a failed response, one line, short."""
    try:
        body = response.json()
        error = body.get("error", body) if isinstance(body, dict) else body
        text = error.get("message", error) if isinstance(error, dict) else error
        if isinstance(text, dict):
            text = text.get("detail", text)
    except (json.JSONDecodeError, ValueError):
        text = response.text
    return " ".join(str(text).split())[:300] or response.reason_phrase
