"""Answers/s and tokens/s of `flashdraft generate --backend openai`, and the client's own cost.

    python bench/openai_client.py                       # starts llama.cpp's server (SmolLM2 GGUF)
    python bench/openai_client.py --base-url URL --model NAME --target HF_DIR   # your server

Runs the real `generate` path (records -> jobs -> local token counts -> concurrent chat
completions with retries -> append-only output) on chitchat prompts (the first user turn of
each conversation), `--prompts` of them at each `--concurrency` level, greedy, at most
`--max-new-tokens` each. For each level: answers/s and answer tokens/s (the server's usage
counts) over the run's wall time (start-up probe excluded).

Then the client alone: the same run against a stub server (`--stub`, a subprocess answering
every request at once with a fixed completion), `--stub-prompts` prompts at concurrency 1 and
the highest level: its wall time per request bounds the client's overhead from above, and
the client process's CPU time per request is its own work (rendering for the token count,
JSON, HTTP, writing records; the stub is another process; the fixed cost of a run, timed as
the same command again with nothing left to do, taken off). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import platform
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from flashdraft import assets
from flashdraft.data.generate import GenerateConfig, Summary, generate
from flashdraft.data.inference import Sampling
from flashdraft.data.openai_backend import ServerOptions

STUB_REPLY = {
    "choices": [{"index": 0, "message": {"content": "Hello there."}, "finish_reason": "stop"}],
    "usage": {"completion_tokens": 4},  # no prompt count: nothing to compare
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", help="a running server (default: start llama.cpp's)")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--target", help="the served model's HF folder (default: SmolLM2)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--server-threads", type=int, default=2, help="llama.cpp's --n_threads")
    parser.add_argument("--stub-prompts", type=int, default=512)
    parser.add_argument("--stub", type=int, help=argparse.SUPPRESS)  # serve the stub on a port
    return parser.parse_args()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_up(url: str, process: subprocess.Popen[bytes], timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited ({process.returncode})")
        try:
            with urllib.request.urlopen(f"{url}/models", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"no answer from {url}")


def start(argv: list[str], port: int) -> tuple[subprocess.Popen[bytes], str]:
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/v1"
    wait_until_up(url, process)
    return process, url


def serve_stub(port: int) -> None:
    body = json.dumps({**STUB_REPLY, "data": [{"id": "stub"}]}).encode()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as real servers do
        disable_nagle_algorithm = True  # else the body waits for the headers' delayed ACK

        def _answer(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _answer

        def log_message(self, format: str, *args: Any) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def run(
    url: str,
    model: str,
    target: str,
    prompts: Path,
    concurrency: int,
    max_new_tokens: int,
    stub: bool = False,
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        config = GenerateConfig(
            target=target,
            prompts=[str(prompts)],
            output=f"{tmp}/out.jsonl",
            backend="openai",
            server=ServerOptions(base_url=url, model=model, concurrency=concurrency),
            sampling=Sampling(max_new_tokens=max_new_tokens),
            keep_truncated=True,
            progress=False,
        )
        summary = Summary()
        cpu = time.process_time()
        generate(config, summary)
        cpu = time.process_time() - cpu
        # The same command again has nothing left to do: its CPU time is the fixed part
        # (tokenizer, probe, reading the output back), taken off the run's.
        fixed = time.process_time()
        generate(config)
        cpu -= time.process_time() - fixed
    requests = summary.written + sum(summary.rejected.values()) + summary.failed
    seconds = summary.seconds - summary.load_s  # the probe excluded
    return {
        "concurrency": concurrency,
        "answers": requests,
        "failed": summary.failed,
        "seconds": round(seconds, 2),
        "answers_per_s": round(requests / seconds, 2),
        "tokens_per_s": round(summary.generated_tokens / seconds, 1),
        # Only against the stub is the client's CPU time large enough to read (a real
        # server's few requests leave it within the noise of the fixed part).
        "client_cpu_ms_per_request": round(1000 * cpu / max(1, requests), 2) if stub else None,
        "wall_ms_per_request": round(1000 * seconds / max(1, requests), 2),
    }


def main() -> int:
    args = parse_args()
    if args.stub is not None:
        serve_stub(args.stub)
        return 0
    target = args.target or str(assets.smollm2_path())
    records = assets.chitchat_conversations(limit=max(args.prompts, args.stub_prompts), seed=0)
    levels = [int(c) for c in args.concurrency.split(",")]
    processes = []
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        prompts, many = Path(tmp) / "prompts.jsonl", Path(tmp) / "many.jsonl"
        for path, count in ((prompts, args.prompts), (many, args.stub_prompts)):
            path.write_text(
                "".join(
                    json.dumps({"id": f"c{i}", "messages": r["messages"][:1]}) + "\n"
                    for i, r in enumerate(records[:count])
                )
            )
        try:
            url, model = args.base_url, args.model
            if url is None:
                port = free_port()
                argv = [sys.executable, "-m", "llama_cpp.server"]
                argv += ["--model", str(assets.smollm2_gguf()), "--model_alias", model]
                argv += ["--port", str(port), "--n_ctx", "2048", "--verbose", "False"]
                argv += ["--n_threads", str(args.server_threads)]
                process, url = start(argv, port)
                processes.append(process)
            for c in levels:
                rows.append({"server": "real", **run(url, model, target, prompts, c, args.max_new_tokens)})  # fmt: skip
            port = free_port()
            process, stub = start([sys.executable, __file__, "--stub", str(port)], port)
            processes.append(process)
            for c in (1, max(levels)):
                rows.append({"server": "stub", **run(stub, "stub", target, many, c, 4, True)})
        finally:
            for process in processes:
                process.terminate()
                process.wait()
    columns = list(rows[0])
    print("  ".join(f"{c:>12}" for c in columns))
    for row in rows:
        print("  ".join(f"{row[c]!s:>12}" for c in columns))
    result = {
        "bench": "openai_client",
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "python": platform.python_version(),
        "cpu": platform.processor() or platform.machine(),
        "prompts": args.prompts,
        "max_new_tokens": args.max_new_tokens,
        "rows": rows,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
