"""trainer_tools.serve_bench's pieces that need no engine: prompt sets, argv templates, the metric."""

import json
from pathlib import Path

import pytest

from trainer_tools.serve_bench import DRAFTS, ENGINES, Request, fill, main, read_set, spec_counters, with_draft_sampling


def test_prompt_sets_in_the_shapes_users_have(tmp_path):
    f = tmp_path / "sets.jsonl"
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
            {"prompt": "p"}, {"question": "q", "answer": "42"}, {"turns": ["t1", "t2"]}, {"problem": "m"},
            {"text": "mbpp"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert read_set(f) == [[{"role": "user", "content": c}] for c in ("a", "p", "q", "t1", "m", "mbpp")]


def test_vllm_argv_carries_the_speculative_config_as_json():
    argv = fill(ENGINES["vllm"]["dflash"], model="/m", draft="/d", port=8000, k=15)
    assert argv[:3] == ["vllm", "serve", "/m"] and "8000" in argv
    assert json.loads(argv[-1]) == {"method": "dflash", "model": "/d", "num_speculative_tokens": 15}
    ngram = json.loads(fill(ENGINES["vllm"]["ngram"], model="/m", draft="/d", port=1, k=7)[-1])
    assert ngram == {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    # --draft-sample-method probabilistic: vLLM's SpeculativeConfig field, in the same JSON; nothing else moves
    sampled = with_draft_sampling(argv, "probabilistic")
    assert sampled[:-1] == argv[:-1] and json.loads(sampled[-1]) == {**json.loads(argv[-1]),
                                                                     "draft_sample_method": "probabilistic"}
    assert with_draft_sampling(argv, "greedy") == argv
    plain = fill(ENGINES["vllm"]["plain"], model="/m", draft="/d", port=1, k=7)
    assert with_draft_sampling(plain, "probabilistic") == plain


def test_the_draft_round_counter_is_read_from_prometheus_text():
    text = ('# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.\n'
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 154.0\n'
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 462.0\n')
    assert [float(v) for v in DRAFTS.findall(text)] == [154.0]


def test_rounds_and_acceptance_per_position_are_read_from_prometheus_text():
    """vLLM's per-position counter (v1/spec_decode/metrics.py: one label "position" per draft
    position), summed over engines; an engine without speculation has none."""
    text = ('vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 10.0\n'
            '# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="0"} 7.0\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="2"} 1.0\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="target",position="1"} 4.0\n'
            'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="target",position="0"} 2.0\n')
    assert spec_counters(text) == (10.0, [9.0, 4.0, 1.0])
    assert spec_counters("vllm:num_requests_running 0.0\n") == (0.0, [])


def test_a_request_carries_the_sampling_and_the_chat_template_kwargs():
    msgs = [{"role": "user", "content": "hi"}]
    greedy = Request(max_tokens=8, top_p=0.9, top_k=20).body(msgs, 3)
    assert greedy == {"model": "target", "messages": msgs, "max_tokens": 8, "temperature": 0.0}
    sampled = Request(max_tokens=8, temperature=0.7, top_p=0.9, top_k=20, seed=5,
                      chat_template_kwargs={"enable_thinking": False}).body(msgs, 3)
    assert sampled == {**greedy, "temperature": 0.7, "top_p": 0.9, "top_k": 20, "seed": 8,
                       "chat_template_kwargs": {"enable_thinking": False}}
    assert "top_p" not in Request(max_tokens=8, temperature=1.0).body(msgs, 0)


@pytest.mark.parametrize(("args", "message"), [
    (["--temperature", "-1"], "--temperature must be a finite number >= 0, not -1.0"),
    (["--top-p", "0"], "--top-p must be in (0, 1], not 0.0"),
    (["--top-k", "-2"], "--top-k must be at least 0 (0: off), not -2"),
    (["--concurrency", "1", "0"], "--concurrency must be at least 1, not 0"),
    (["--chat-template-kwargs", "{enable"], "argument --chat-template-kwargs: not JSON"),
    (["--chat-template-kwargs", "[1]"], "argument --chat-template-kwargs: must be a JSON object, not list"),
    (["--engine", "sglang", "--draft-sample-method", "probabilistic"],
     "--draft-sample-method probabilistic: vLLM's setting; for sglang, its own flag in --argv"),
])
def test_bad_sampling_settings_are_one_line_errors_before_any_engine_starts(tmp_path, capsys, args, message):
    with pytest.raises(SystemExit) as done:
        main(["--model", "m", "--draft", "d", "--set", f"s={tmp_path / 'none.jsonl'}", "--out", str(tmp_path / "o.json"),
              *args])
    assert done.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


# A stand-in engine: writes its pid, then (unless told to hang) serves /v1/models on the port.
STAND_IN = r"""
import http.server, os, sys, time
open(sys.argv[2], "w").write(str(os.getpid()))
if sys.argv[3] == "hang":
    time.sleep(600)

class Models(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b'{"data": []}')
    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Models).serve_forever()
"""


def _serve_bench_argv(tmp_path, port: int, how: str, timeout: float = 600.0) -> list[str]:
    import sys

    engine = tmp_path / "engine.py"
    engine.write_text(STAND_IN)
    (tmp_path / "draft").mkdir(exist_ok=True)
    (tmp_path / "draft" / "config.json").write_text('{"block_size": 4}')
    (tmp_path / "p.jsonl").write_text('{"prompt": "p"}\n')
    argv = {"plain": [sys.executable, str(engine), "{port}", str(tmp_path / "engine.pid"), how]}
    return ["--argv", json.dumps(argv), "--modes", "plain", "--model", "/m", "--draft", str(tmp_path / "draft"),
            "--set", f"p={tmp_path / 'p.jsonl'}", "--port", str(port), "--serve-timeout", str(timeout),
            "--out", str(tmp_path / "out" / "bench.json")]


def test_a_port_something_already_answers_is_refused_before_an_engine_starts(tmp_path):
    """serve-bench benchmarked whatever already listened on its port and exited 0."""
    import http.server
    import threading

    from tests.conftest import free_port
    from trainer_tools.serve_bench import main

    port = free_port()
    other = http.server.HTTPServer(("127.0.0.1", port), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        with pytest.raises(SystemExit) as done:
            main(_serve_bench_argv(tmp_path, port, "serve"))
    finally:
        other.shutdown()
        other.server_close()
    assert str(done.value).startswith(f"serve_bench: port {port} is already in use")
    assert not (tmp_path / "engine.pid").exists()  # no engine was started
    assert not (tmp_path / "out" / "bench.json").exists()


def test_a_server_that_is_not_the_engine_started_is_not_taken_for_it(tmp_path):
    """The engine started answers nothing itself; another process (not of its process group) serves
    the port: that is not readiness."""
    import os
    import signal
    import subprocess
    import sys

    from tests.conftest import free_port
    from trainer_tools.serve_bench import main

    port = free_port()
    (tmp_path / "engine.py").write_text(STAND_IN)
    # the "engine" starts a server in a session of its own, then hangs
    detach = tmp_path / "detach.py"
    detach.write_text("import subprocess, sys, time\n"
                      f"subprocess.Popen([sys.executable, {str(tmp_path / 'engine.py')!r}, sys.argv[1], "
                      f"{str(tmp_path / 'other.pid')!r}, 'serve'], start_new_session=True)\n"
                      "time.sleep(600)\n")
    argv = _serve_bench_argv(tmp_path, port, "serve")
    argv[1] = json.dumps({"plain": [sys.executable, str(detach), "{port}"]})
    try:
        with pytest.raises(SystemExit) as done:
            main(argv)
        assert f"port {port} is answered by pid" in str(done.value) and "not by the engine it started" in str(done.value)
    finally:
        if (tmp_path / "other.pid").exists():
            os.kill(int((tmp_path / "other.pid").read_text()), signal.SIGKILL)
    assert subprocess.run(["pgrep", "-f", str(detach)], capture_output=True).returncode == 1  # the engine was stopped


@pytest.mark.parametrize("how", ["timeout", "SIGINT", "SIGTERM"])
def test_an_engine_still_starting_is_stopped_on_every_way_out(tmp_path, how):
    """Ctrl-C (or SIGTERM, or the readiness timeout) while the engine starts used to leave it running,
    holding the GPU."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import free_port
    from tests.procs import alive

    root = Path(__file__).resolve().parents[2]
    argv = [sys.executable, "-m", "trainer_tools.serve_bench",
            *_serve_bench_argv(tmp_path, free_port(), "hang", timeout=3 if how == "timeout" else 600)]
    # SIGINT as a terminal's Ctrl-C finds it: a test runner started in the background by a shell (`&`)
    # inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler
    bench = subprocess.Popen(argv, cwd=root, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pid_file = tmp_path / "engine.pid"
    try:
        for _ in range(600):
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.05)
        engine = int(pid_file.read_text())
        if how != "timeout":
            bench.send_signal(getattr(signal, how))
        _, err = bench.communicate(timeout=120)
    finally:  # a serve_bench that did not stop, and its engine, stopped here
        bench.kill()
        bench.wait()
        if pid_file.exists() and pid_file.read_text() and alive(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert bench.returncode != 0
    assert not alive(engine), "the engine outlived serve_bench"
    if how == "timeout":
        assert "the engine did not serve within 3s" in err
