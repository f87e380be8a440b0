"""regen against servers that misbehave (issue 26): an answer that did not finish is never written
as a success, every answer is validated, --timeout bounds a whole request, a cut response is
retried, Ctrl-C ends regen at once writing what is complete, a dead server stops it early."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from trainer_tools import regen


def answer(content: object = "fine", finish: object = "stop", **extra: object) -> dict:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": finish}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2}, **extra}


class Stub:
    """An HTTP server whose replies a test scripts: each request pops the next behaviour
    (the last one repeats). A behaviour is a dict (sent as JSON), or one of the strings
    'cut' (a Content-Length the body never reaches), 'drip' (one byte a second, forever),
    'hang' (no reply at all)."""

    def __init__(self, *behaviours: object) -> None:
        self.behaviours = list(behaviours)
        self.requests = 0
        self.lock = threading.Lock()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                self.rfile.read(int(self.headers["Content-Length"]))
                with stub.lock:
                    stub.requests += 1
                    what = stub.behaviours.pop(0) if len(stub.behaviours) > 1 else stub.behaviours[0]
                try:
                    stub.reply(self, what)
                except OSError:
                    pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    @staticmethod
    def reply(handler: BaseHTTPRequestHandler, what: object) -> None:
        if what == "hang":
            time.sleep(3600)
        body = json.dumps(what).encode() if not isinstance(what, str) else json.dumps(answer()).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        if what == "cut":  # half the reply, then the connection closes (a proxy or server dying mid-body)
            handler.wfile.write(body[: len(body) // 2])
            handler.wfile.flush()
            handler.close_connection = True
            return
        if what == "drip":
            for byte in body:
                handler.wfile.write(bytes([byte]))
                handler.wfile.flush()
                time.sleep(1.0)
            return
        handler.wfile.write(body)
        handler.wfile.flush()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def stub():
    made: list[Stub] = []

    def make(*behaviours: object) -> Stub:
        made.append(Stub(*behaviours))
        return made[-1]

    yield make
    for s in made:
        s.close()


def prompts_file(tmp_path: Path, n: int = 1) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"q{i}"}]}) + "\n"
                            for i in range(n)))
    return path


def run(url: str, tmp_path: Path, capsys, *extra: object, n: int = 1) -> tuple[int, str, str, list[dict]]:
    out = tmp_path / "regen.jsonl"
    code = regen.main(["--endpoint", url, "--model", "m", "--in", str(prompts_file(tmp_path, n)), "--out", str(out),
                       "--retries", "1", "--max-tokens", "16", *map(str, extra)])
    stdout, stderr = capsys.readouterr()
    rows = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    return code, stdout, stderr, rows


@pytest.mark.parametrize("bad, why", [
    (answer(finish="abort"), "the answer did not finish (finish_reason 'abort')"),
    (answer(finish=None), "the answer did not finish (finish_reason None)"),
    ({"object": "error", "message": "out of KV cache", "type": "InternalError", "code": 500},
     "the server answered with an error: out of KV cache"),
    ({"error": {"message": "engine died"}}, "the server answered with an error: engine died"),
    (answer(content=None), "the answer's content is NoneType, not text"),
    (answer(content=["a", "list"]), "the answer's content is list, not text"),
    (answer(content="x" * (64 * 16 + 4097)), "more than 5120 (64 per --max-tokens token)"),
    ([1, 2], "the reply is a JSON list, not an object"),
    ({**answer(), "usage": {"prompt_tokens": 3, "completion_tokens": 17}},
     "the server reports 17 completion tokens, more than the --max-tokens 16 asked for"),
])
def test_an_answer_that_did_not_finish_or_is_not_text_is_retried_then_failed(stub, tmp_path, capsys, bad, why):
    server = stub(bad)
    code, stdout, stderr, rows = run(server.url, tmp_path, capsys)
    assert code == regen.EXIT_FAILURES and rows == [], "never written as an answer"
    assert why in stderr and "(after 2 attempts)" in stderr and server.requests == 2
    assert "0 regenerated, 0 already done, 1 failed" in stdout
    recovered = stub(bad, answer("42"))  # the retry gets a real answer: that one is written
    code, stdout, stderr, rows = run(recovered.url, tmp_path, capsys)
    assert code == 0 and [r["messages"][-1]["content"] for r in rows] == ["42"] and "1 retries" in stdout


def test_a_response_cut_mid_body_is_retried(stub, tmp_path, capsys):
    server = stub("cut", answer("whole"))
    code, stdout, stderr, rows = run(server.url, tmp_path, capsys)
    assert code == 0, stderr
    assert [r["messages"][-1]["content"] for r in rows] == ["whole"] and server.requests == 2


def test_timeout_bounds_the_whole_request_not_one_read(stub, tmp_path, capsys):
    """A server that sends a byte a second (its reply would take minutes) never trips a per-read
    timeout: the request as a whole is cut at --timeout."""
    server = stub("drip")
    code, stdout, stderr, rows = run(server.url, tmp_path, capsys, "--timeout", "1.5", "--retries", "0")
    assert code == regen.EXIT_FAILURES and rows == []
    assert "no complete reply within --timeout 1.5s" in stderr


def test_a_dead_server_stops_regen_early_with_one_line(tmp_path, capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code, stdout, stderr, rows = run(f"http://127.0.0.1:{port}", tmp_path, capsys, "--retries", "0",
                                     "--max-consecutive-failures", "5", "-n", "2", n=200)
    assert code == regen.EXIT_FAILURES and rows == []
    stopped = [line for line in stderr.splitlines() if "in a row" in line]
    assert len(stopped) == 1 and stopped[0].startswith("regen: stopped after 5 conversations failed in a row (last: ")
    assert "rerun the same command to resume" in stopped[0]
    assert " 5 failed" in stdout or " 6 failed" in stdout  # the ones in flight may finish failing too


def test_ctrl_c_ends_regen_within_a_second_writing_what_is_complete(stub, tmp_path):
    """Two conversations answer at once, the others hang (an hour): SIGINT ends the process at once
    (not after the requests in flight), with the two answers written whole."""
    server = stub(answer("a"), answer("b"), "hang")
    out = tmp_path / "regen.jsonl"
    argv = [sys.executable, "-m", "trainer_tools.regen", "--endpoint", server.url, "--model", "m",
            "--in", str(prompts_file(tmp_path, 6)), "--out", str(out), "-n", "4", "--timeout", "600"]
    # SIGINT as at a terminal: a test run started in the background has it ignored, and exec keeps that
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 120
        while server.requests < 4 or not out.exists() or out.read_text().count("\n") < 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=120)  # waiting for the hung requests would take an hour
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, stderr
    assert "interrupted; the answers that were complete are written" in stderr
    assert sorted(json.loads(line)["messages"][-1]["content"] for line in out.read_text().splitlines()) == ["a", "b"]
