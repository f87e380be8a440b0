"""A small OpenAI-compatible server for tests and the simulated node (stdlib http.server).

    python -m trainer.testing.openai_server --model-path DIR [--port 30000] [--served-model-name NAME]

It stands in for SGLang / vLLM where the real path talks to one: real generation through
the model in DIR (trainer.regen.HFEngine, one request at a time, so a prompt's answer does
not depend on what else is in flight; greedy at temperature 0, seeded sampling otherwise),
behind the routes and replies those servers give:

  GET  /health                  200 once the model is loaded, 503 while loading
  GET  /v1/models               {"object": "list", "data": [{"id": NAME, ...}]}; 503 while loading
                                (a real server only listens once loaded: this route means ready)
  POST /v1/chat/completions     non-streaming; finish_reason "stop" or "length", usage counts;
                                404 for another model name, 400 for a bad body or a prompt
                                that does not fit --max-model-len (vLLM's wording)

The port is bound before the model loads (like a server still starting); `--fail-first N`
answers the first N completions with 503 (a server under load), to exercise client retries.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from dataclasses import KW_ONLY, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from pathlib import Path

from trainer.regen import Completion, HFEngine, RegenError, Sampling


@dataclass(eq=False)
class ModelServer:
    """The state behind the routes: the engine once loaded, and the fault counters."""

    model_path: str
    served_name: str
    _: KW_ONLY
    max_model_len: int | None = None
    fail_first: int = 0
    device: str = "cpu"
    engine: HFEngine | None = field(default=None, init=False)
    load_error: str | None = field(default=None, init=False)
    requests: int = field(default=0, init=False)  # completions that reached the model
    received: int = field(default=0, init=False)  # every POST /v1/chat/completions
    created: int = field(default_factory=lambda: int(time.time()), init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def load(self) -> None:
        try:
            self.engine = HFEngine(self.model_path, Sampling(), device=self.device, batch_size=1,
                                   max_model_len=self.max_model_len)
            print(f"openai_server: {self.served_name} loaded from {self.model_path}", flush=True)
        except Exception as e:  # noqa: BLE001 - reported by /health and on stderr
            self.load_error = f"{type(e).__name__}: {e}"
            print(f"openai_server: cannot load {self.model_path}: {self.load_error}", file=sys.stderr, flush=True)

    def complete(self, body: dict) -> tuple[int, dict]:
        with self._lock:
            self.received += 1
        engine = self.engine
        if engine is None:
            return 503, _error("the model is still loading" if self.load_error is None else self.load_error,
                               "ServiceUnavailableError", 503)
        if body.get("model") != self.served_name:
            return 404, _error(f"The model `{body.get('model')}` does not exist.", "NotFoundError", 404)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            return 400, _error("messages must be a non-empty list of {role, content}", "BadRequestError", 400)
        if body.get("stream"):
            return 400, _error("this stand-in does not stream; send stream: false", "BadRequestError", 400)
        try:
            max_tokens = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
            temperature = float(body.get("temperature", 1.0))
            top_p = float(body.get("top_p", 1.0))
        except (TypeError, ValueError):
            return 400, _error("max_tokens, temperature and top_p must be numbers", "BadRequestError", 400)
        if max_tokens < 1:
            return 400, _error("max_tokens must be at least 1", "BadRequestError", 400)
        with self._lock:  # one generation at a time: deterministic whatever else is in flight
            self.requests += 1
            if self.requests <= self.fail_first:
                return 503, _error("server overloaded, retry later", "ServiceUnavailableError", 503)
            kwargs = body.get("chat_template_kwargs") or {}
            engine.sampling = Sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                       extra={"chat_template_kwargs": kwargs} if kwargs else {})
            try:
                ids = engine.prompt_ids(messages)
            except Exception as e:  # noqa: BLE001 - a template error is the client's request
                return 400, _error(f"cannot apply the chat template: {e}", "BadRequestError", 400)
            limit = engine.max_model_len
            if limit is not None and len(ids) + max_tokens > limit:
                return 400, _error(f"This model's maximum context length is {limit} tokens. However, you requested "
                                   f"{len(ids) + max_tokens} tokens ({len(ids)} in the messages, {max_tokens} in the "
                                   "completion). Please reduce the length of the messages or completion.",
                                   "BadRequestError", 400)
            engine.seed = int(body.get("seed", 0)) if isinstance(body.get("seed", 0), int) else 0
            try:
                c: Completion = engine.generate([ids])[0]
            except RegenError as e:
                return 500, _error(str(e), "InternalServerError", 500)
        return 200, {
            "id": f"chatcmpl-{self.requests}", "object": "chat.completion", "created": int(time.time()),
            "model": self.served_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": c.content},
                         "finish_reason": c.finish_reason}],
            "usage": {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
                      "total_tokens": c.prompt_tokens + c.completion_tokens},
        }


def _error(message: str, kind: str, code: int) -> dict:
    return {"error": {"message": message, "type": kind, "code": code}}


def make_handler(server_state: ModelServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - http.server's signature
            pass

        def _reply(self, code: int, doc: dict) -> None:
            data = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path == "/health":
                ready = server_state.engine is not None
                self._reply(200 if ready else 503, {"status": "ok" if ready else "loading"})
            elif self.path == "/v1/models":
                if server_state.engine is None:  # SGLang and vLLM only answer once the model is loaded
                    self._reply(503, _error("the model is still loading", "ServiceUnavailableError", 503))
                    return
                self._reply(200, {"object": "list", "data": [
                    {"id": server_state.served_name, "object": "model", "created": server_state.created,
                     "owned_by": "dflash-stand-in", "max_model_len": server_state.max_model_len}]})
            else:
                self._reply(404, _error(f"no route {self.path}", "NotFoundError", 404))

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/v1/chat/completions":
                self._reply(404, _error(f"no route {self.path}", "NotFoundError", 404))
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(length))
                if not isinstance(body, dict):
                    raise ValueError("not an object")
            except ValueError as e:
                self._reply(400, _error(f"invalid JSON body: {e}", "BadRequestError", 400))
                return
            self._reply(*server_state.complete(body))

    return Handler


def serve(model_path: str, *, host: str = "127.0.0.1", port: int = 0, served_name: str | None = None,
          max_model_len: int | None = None, fail_first: int = 0, device: str = "cpu",
          load_in_background: bool = True) -> tuple[ThreadingHTTPServer, ModelServer]:
    """Bind, start serving in a daemon thread, load the model; returns (http server, state).

    `httpd.server_address[1]` is the port; `httpd.shutdown()` stops it."""
    state = ModelServer(model_path, served_name or Path(model_path).name, max_model_len=max_model_len,
                        fail_first=fail_first, device=device)
    httpd = ThreadingHTTPServer((host, port), make_handler(state))
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, name="openai-server", daemon=True).start()
    if load_in_background:
        threading.Thread(target=state.load, name="openai-server-load", daemon=True).start()
    else:
        state.load()
    return httpd, state


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer.testing.openai_server", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--served-model-name", default=None, help="default: the model directory's name")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--fail-first", type=int, default=0, help="answer the first N completions with 503")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    if not os.path.isdir(args.model_path):
        print(f"openai_server: --model-path {args.model_path}: not a directory", file=sys.stderr)
        return 2
    try:
        httpd, state = serve(args.model_path, host=args.host, port=args.port, served_name=args.served_model_name,
                             max_model_len=args.max_model_len, fail_first=args.fail_first, device=args.device)
    except OSError as e:
        print(f"openai_server: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    print(f"openai_server: listening on http://{args.host}:{httpd.server_address[1]} "
          f"serving {state.served_name} (loading)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(0.5):
        if state.load_error is not None:
            httpd.shutdown()
            return 1
    httpd.shutdown()
    print("openai_server: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
