"""A small OpenAI-compatible completions server (a real HTTP server on a thread) for `bench engine` tests.

It streams `answer` as one SSE event per word, remembers every prompt it was sent, and can be told
to fail a request so error accounting is exercised.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class FakeOpenAI:
    def __init__(self, model: str = "fake-llm", fail_every: int = 0) -> None:
        self.model = model
        self.fail_every = fail_every
        self.prompts: list[Any] = []
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _json(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": owner.model, "object": "model"}]})
                else:
                    self._json(404, {"error": "not found"})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with owner.lock:
                    owner.prompts.append(body["prompt"])
                    n = len(owner.prompts)
                if self.path != "/v1/completions" or body.get("model") != owner.model:
                    self._json(404, {"error": "unknown model or path"})
                    return
                if owner.fail_every and n % owner.fail_every == 0:
                    self._json(500, {"error": "injected failure"})
                    return
                words = [f" ans{n}w{i}" for i in range(body["max_tokens"])]
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for w in words:
                    self._chunk({"choices": [{"index": 0, "text": w}]})
                prompt_tokens = len(body["prompt"]) if isinstance(body["prompt"], list) else len(body["prompt"].split())
                self._chunk({"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(words)}})
                self._raw(b"data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")

            def _chunk(self, event: dict[str, Any]) -> None:
                self._raw(f"data: {json.dumps(event)}\n\n".encode())

            def _raw(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __enter__(self) -> FakeOpenAI:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
