"""`python -m trainer_tools.regen` against the OpenAI-compatible stand-in serving a tiny model directory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trainer_tools import regen
from trainer_tools.fixtures.openai_server import serve

PROMPTS = [
    {"id": "a", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "step3 v17"},
                             {"role": "assistant", "content": "the dataset's own answer is dropped"}]},
    {"id": "b", "conversations": [{"from": "human", "value": "step1 v2"}, {"from": "gpt", "value": "old"},
                                  {"from": "human", "value": "step7 v9"}, {"from": "gpt", "value": "old too"}]},
    {"prompt": "step7 v30"},
    *({"id": f"p{i}", "messages": [{"role": "user", "content": f"step{(1, 3, 7)[i % 3]} v{i}"}]} for i in range(9)),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return write_fixture_model(tmp_path_factory.mktemp("regen") / "tiny-target")


def write_fixture_model(out: Path) -> Path:
    try:
        from trainer_tools.fixtures.hub_model import write_hub_model
    except ImportError:  # the hub-format fixture lands with issue 12 items 1-2; until then a plain save
        return _save_tiny(out)
    return write_hub_model(out, "qwen3")


def _save_tiny(out: Path) -> Path:
    from trainer.data.synth import synthetic_words
    from trainer.data.tokenizer import synthetic_tokenizer
    from trainer.models.target import tiny_target
    from trainer.run.config import TinyTargetConfig

    tok = synthetic_tokenizer(synthetic_words())
    model = tiny_target(TinyTargetConfig(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=64), len(tok))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(model_dir):
    httpd, state = serve(str(model_dir), served_name="tiny", max_model_len=64, load_in_background=False)
    yield f"http://127.0.0.1:{httpd.server_address[1]}", state
    httpd.shutdown()


def write_prompts(path: Path, rows=PROMPTS) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().split(b"\n") if line.strip()]


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    code = regen.main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def test_every_user_turn_is_answered_by_the_server(server, tmp_path, capsys):
    url, _ = server
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    out = tmp_path / "regen.jsonl"
    code, stdout, err = run_cli(["--endpoint", url, "--model", "tiny", "--in", prompts, "--out", out,
                                 "-n", 4, "--max-tokens", 6], capsys)
    assert code == 0, err
    assert "12 regenerated, 0 already done, 0 failed" in stdout
    got = {r["id"]: r for r in records(out)}
    assert len(got) == len(records(out)) == 12
    a = got["a"]["messages"]
    assert [m["role"] for m in a] == ["system", "user", "assistant"]
    assert a[2]["content"] != "the dataset's own answer is dropped"
    b = got["b"]["messages"]
    assert [m["role"] for m in b] == ["user", "assistant", "user", "assistant"]
    assert [b[0]["content"], b[2]["content"]] == ["step1 v2", "step7 v9"]
    assert len(got["b"]["finish_reasons"]) == 2
    prompt_row = next(r for r in got.values() if r["id"].startswith("sha256:"))
    assert prompt_row["messages"][0] == {"role": "user", "content": "step7 v30"}
    assert all(r["model"] == "tiny" for r in got.values())


def test_answers_do_not_depend_on_concurrency(server, model_dir, tmp_path, capsys):
    url, _ = server
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    outputs = []
    for n in (1, 6):
        out = tmp_path / f"regen-{n}.jsonl"
        assert run_cli(["--endpoint", url, "--model", "tiny", "--in", prompts, "--out", out, "-n", n,
                        "--max-tokens", 5], capsys)[0] == 0
        outputs.append({r["id"]: r["messages"] for r in records(out)})
    assert outputs[0] == outputs[1]
    engine = regen.HFEngine(str(model_dir), regen.Sampling(max_tokens=5), batch_size=1)
    try:
        direct = engine.complete([{"role": "user", "content": "step1 v0"}])
    finally:
        engine.close()
    assert outputs[0]["p0"][1]["content"] == direct.content


def test_interrupted_run_resumes_without_duplicates(server, tmp_path, capsys):
    url, _ = server
    prompts, _ = regen.read_prompts(write_prompts(tmp_path / "prompts.jsonl"))
    out = tmp_path / "regen.jsonl"
    engine = regen.OpenAIEngine([url], "tiny", regen.Sampling(max_tokens=4))
    output = regen.Output(out)

    def interrupt(summary):
        if summary.done >= 3:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        regen.regenerate(prompts, engine, output, model="tiny", concurrency=2, on_progress=interrupt)
    output.close()
    first = records(out)
    assert 3 <= len(first) < 12
    with open(out, "ab") as f:  # a crash in the middle of a write leaves a torn last line
        f.write(b'{"id": "p8", "messages": [{"role": "us')
    code, stdout, err = run_cli(["--endpoint", url, "--model", "tiny", "--in", tmp_path / "prompts.jsonl",
                                 "--out", out, "-n", 3, "--max-tokens", 4], capsys)
    assert code == 0, err
    assert f"{12 - len(first)} regenerated, {len(first)} already done" in stdout
    assert "cut a torn last line" in stdout
    final = records(out)
    assert sorted(r["id"] for r in final) == sorted(p.id for p in prompts)
    assert final[: len(first)] == first
    assert out.read_bytes().endswith(b"\n")


def test_failures_are_counted_and_retried_by_a_rerun(server, tmp_path, capsys):
    url, _ = server
    rows = [{"id": "long", "messages": [{"role": "user", "content": " ".join(["v1"] * 80)}]},
            {"id": "short", "messages": [{"role": "user", "content": "step1 v1"}]}]
    prompts = write_prompts(tmp_path / "prompts.jsonl", rows)
    out = tmp_path / "regen.jsonl"
    args = ["--endpoint", url, "--model", "tiny", "--in", prompts, "--out", out, "--max-tokens", 4]
    code, stdout, err = run_cli(args, capsys)
    assert code == regen.EXIT_FAILURES
    assert "1 regenerated, 0 already done, 1 failed" in stdout
    assert "long (input line 1)" in err and "HTTP 400" in err and "maximum context length is 64" in err
    assert [r["id"] for r in records(out)] == ["short"]
    code, stdout, _ = run_cli(args, capsys)
    assert code == regen.EXIT_FAILURES
    assert "0 regenerated, 1 already done, 1 failed" in stdout


def test_unknown_model_fails_without_retrying(server, tmp_path, capsys):
    url, state = server
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[3:4])
    before = state.received
    code, _, err = run_cli(["--endpoint", url, "--model", "nope", "--in", prompts, "--out", tmp_path / "o.jsonl"], capsys)
    assert code == regen.EXIT_FAILURES
    assert "HTTP 404: The model `nope` does not exist." in err
    assert state.received == before + 1


def test_overloaded_server_is_retried(model_dir, tmp_path):
    httpd, state = serve(str(model_dir), served_name="tiny", fail_first=3, load_in_background=False)
    try:
        engine = regen.OpenAIEngine([f"127.0.0.1:{httpd.server_address[1]}"], "tiny", regen.Sampling(max_tokens=3),
                                    retries=3, backoff=0.01)
        prompts, _ = regen.read_prompts(write_prompts(tmp_path / "prompts.jsonl", PROMPTS[3:5]))
        output = regen.Output(tmp_path / "regen.jsonl")
        summary = regen.regenerate(prompts, engine, output, model="tiny", concurrency=1)
        output.close()
    finally:
        httpd.shutdown()
    assert (summary.done, summary.failed, summary.retries) == (2, 0, 3)


def test_truncations_are_counted(server, tmp_path, capsys):
    url, _ = server
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[3:])
    out = tmp_path / "regen.jsonl"
    code, stdout, _ = run_cli(["--endpoint", url, "--model", "tiny", "--in", prompts, "--out", out,
                               "--max-tokens", 2], capsys)
    assert code == 0
    truncated = sum("length" in r["finish_reasons"] for r in records(out))
    assert truncated >= 1
    assert f"{truncated} truncated (finish_reason length)" in stdout


def test_hf_engine_without_a_server(model_dir, tmp_path, capsys):
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    out = tmp_path / "regen.jsonl"
    code, stdout, err = run_cli(["--engine", "hf", "--model-path", model_dir, "--in", prompts, "--out", out,
                                 "-n", 4, "--max-tokens", 5], capsys)
    assert code == 0, err
    assert "12 regenerated" in stdout
    got = records(out)
    assert len({r["id"] for r in got}) == 12
    assert all(r["model"] == "tiny-target" for r in got)
    assert all(r["messages"][-1]["role"] == "assistant" for r in got)


@pytest.mark.parametrize("line, message", [
    ("not json", "prompts.jsonl:2: not JSON"),
    ('{"text": "hi"}', "prompts.jsonl:2: unknown record; expected one JSON object per line with 'messages' (OpenAI)"),
    ('{"messages": [{"role": "assistant", "content": "x"}]}', "prompts.jsonl:2: no user turn to answer"),
    ('{"id": "p1", "prompt": "again"}', "prompts.jsonl:2: id 'p1' used again (first at line 1)"),
])
def test_bad_input_names_file_and_line(tmp_path, capsys, line, message):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "p1", "prompt": "hi"}\n' + line + "\n")
    code, _, err = run_cli(["--endpoint", "http://127.0.0.1:9", "--model", "m", "--in", prompts,
                            "--out", tmp_path / "o.jsonl"], capsys)
    assert code == regen.EXIT_USAGE
    assert message in err
    assert "Traceback" not in err


def test_an_output_damaged_in_the_middle_is_refused(tmp_path, capsys):
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[3:4])
    out = tmp_path / "o.jsonl"
    out.write_bytes(b'{"id": "x"}\ngarbage\n{"id": "y"}\n')
    code, _, err = run_cli(["--endpoint", "http://127.0.0.1:9", "--model", "m", "--in", prompts, "--out", out], capsys)
    assert code == regen.EXIT_USAGE
    assert "o.jsonl:2: not a regen record; refusing to append to it" in err
    assert out.read_bytes() == b'{"id": "x"}\ngarbage\n{"id": "y"}\n'


def test_engine_arguments_are_checked(tmp_path, capsys):
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[3:4])
    code, _, err = run_cli(["--in", prompts, "--out", tmp_path / "o.jsonl"], capsys)
    assert code == regen.EXIT_USAGE and "give --endpoint URL" in err
    code, _, err = run_cli(["--engine", "hf", "--model-path", tmp_path / "missing", "--in", prompts,
                            "--out", tmp_path / "o.jsonl"], capsys)
    assert code == regen.EXIT_USAGE and "--engine hf needs --model-path DIR" in err


@pytest.mark.parametrize("endpoint, url", [
    ("http://h:30000", "http://h:30000/v1/chat/completions"),
    ("h:8000/", "http://h:8000/v1/chat/completions"),
    ("https://h/v1", "https://h/v1/chat/completions"),
])
def test_endpoint_forms(endpoint, url):
    assert regen.chat_url(endpoint) == url


@pytest.mark.slow
def test_killed_process_resumes(server, tmp_path):
    """SIGKILL in the middle of a run (no cleanup at all), then the same command again."""
    url, _ = server
    rows = [{"id": f"k{i}", "messages": [{"role": "user", "content": f"step1 v{i}"}]} for i in range(40)]
    prompts = write_prompts(tmp_path / "prompts.jsonl", rows)
    out = tmp_path / "regen.jsonl"
    argv = [sys.executable, "-m", "trainer_tools.regen", "--endpoint", url, "--model", "tiny", "--in", str(prompts),
            "--out", str(out), "-n", "2", "--max-tokens", "8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        while proc.poll() is None and (not out.exists() or out.read_bytes().count(b"\n") < 5):
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    done_before = out.read_bytes().count(b"\n")
    assert 5 <= done_before < 40
    second = subprocess.run(argv, capture_output=True, text=True, env=env)
    assert second.returncode == 0, second.stderr
    assert "already done" in second.stdout
    assert sorted(r["id"] for r in records(out)) == sorted(r["id"] for r in rows)


def test_the_stand_in_is_not_ready_until_its_model_is_loaded(model_dir):
    import threading
    import urllib.error
    import urllib.request
    from http.server import ThreadingHTTPServer

    from trainer_tools.fixtures.openai_server import ModelServer, make_handler

    state = ModelServer(str(model_dir), "tiny")
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        for route in ("/health", "/v1/models"):
            with pytest.raises(urllib.error.HTTPError) as info:
                urllib.request.urlopen(base + route)
            assert info.value.code == 503
        state.load()
        with urllib.request.urlopen(base + "/v1/models") as response:
            assert json.loads(response.read())["data"][0]["id"] == "tiny"
    finally:
        httpd.shutdown()


def test_ctrl_c_while_the_engine_stops_exits_130_with_whole_lines(model_dir, tmp_path, capsys, monkeypatch):
    """A run that stops on its own (here: it is done) waits in close() for the HF engine's thread
    to leave its batch; a Ctrl-C arriving then (the quality bench's deadline, or a second Ctrl-C)
    is an interruption (exit 130 and one line), not a traceback with exit 1."""
    close = regen.HFEngine.close

    def interrupted_close(self):
        close(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(regen.HFEngine, "close", interrupted_close)
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    out = tmp_path / "regen.jsonl"
    code, _, err = run_cli(["--engine", "hf", "--model-path", model_dir, "--in", prompts, "--out", out,
                            "-n", 4, "--max-tokens", 3], capsys)
    assert code == 130
    assert "interrupted while the engine was stopping" in err and "Traceback" not in err
    assert len({r["id"] for r in records(out)}) == 12


def test_the_hf_engine_refuses_a_model_whose_weights_hold_nan(model_dir, tmp_path, capsys):
    """A checkpoint with NaN weights decoded garbage, written as successful answers."""
    from tests.trainer.test_quantized_checkpoints import _altered, _set_first

    broken = _altered(Path(model_dir), tmp_path / "broken", "model.layers.1.mlp.down_proj.weight",
                      _set_first(float("nan")))
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[3:4])
    out = tmp_path / "o.jsonl"
    code, _, err = run_cli(["--engine", "hf", "--model-path", broken, "--in", prompts, "--out", out], capsys)
    assert code == regen.EXIT_USAGE and (not out.exists() or records(out) == [])
    [said] = [line for line in err.splitlines() if line.startswith("regen: ")]  # beside transformers' progress bar
    assert said.startswith(f"regen: {broken}: tensor model.layers.1.mlp.down_proj.weight holds 1 NaN/inf value(s)")
    assert "Traceback" not in err


def answers(rows: list[dict]) -> dict[str, list[str]]:
    """Each prompt's sampled answers (the last assistant turn), by sample index."""
    by_prompt: dict[str, dict[int, str]] = {}
    for r in rows:
        assert r["id"] == f"{r['prompt_id']}#{r['sample']}"
        by_prompt.setdefault(r["prompt_id"], {})[r["sample"]] = r["messages"][-1]["content"]
    return {pid: [got[k] for k in sorted(got)] for pid, got in by_prompt.items()}


def test_samples_per_prompt_are_distinct_seeded_rows_and_resume_adds_only_the_missing(server, tmp_path, capsys):
    url, _ = server
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[3:9])
    out = tmp_path / "regen.jsonl"
    sampled = ["--endpoint", url, "--model", "tiny", "--in", prompts, "--out", out, "-n", 3, "--max-tokens", 6,
               "--temperature", 1.0, "--top-p", 0.95]
    code, stdout, err = run_cli([*sampled, "--samples-per-prompt", 2], capsys)
    assert code == 0, err
    assert "12 regenerated, 0 already done" in stdout
    first = records(out)
    assert len({r["seed"] for r in first}) == 12
    # a rerun asking for 4 samples adds samples 2 and 3 of every prompt, repeating none
    code, stdout, err = run_cli([*sampled, "--samples-per-prompt", 4], capsys)
    assert code == 0, err
    assert "12 regenerated, 12 already done" in stdout
    final = records(out)
    assert final[:12] == first
    got = answers(final)
    assert sorted(got) == [f"p{i}" for i in range(6)] and all(len(a) == 4 for a in got.values())
    assert all(len(set(a)) > 1 for a in got.values()), got  # distinct seeds give distinct answers
    # each sample's seed travels with its request: regenerated alone, sample 3 of p0 is the same answer
    again = tmp_path / "again.jsonl"
    one = write_prompts(tmp_path / "one.jsonl", [PROMPTS[3]])
    assert run_cli(["--endpoint", url, "--model", "tiny", "--in", one, "--out", again, "--max-tokens", 6,
                    "--temperature", 1.0, "--top-p", 0.95, "--samples-per-prompt", 4], capsys)[0] == 0
    assert answers(records(again))["p0"] == got["p0"]


def test_samples_per_prompt_with_the_hf_engine(model_dir, tmp_path, capsys):
    """Without --temperature the samples are drawn at T = 1 (the recipe ablation's sampled data, #50)."""
    prompts = write_prompts(tmp_path / "prompts.jsonl", PROMPTS[3:7])
    out = tmp_path / "regen.jsonl"
    code, stdout, err = run_cli(["--engine", "hf", "--model-path", model_dir, "--in", prompts, "--out", out,
                                 "-n", 4, "--max-tokens", 6, "--samples-per-prompt", 3], capsys)
    assert code == 0, err
    assert "12 regenerated" in stdout
    got = answers(records(out))
    assert sorted(got) == ["p0", "p1", "p2", "p3"] and all(len(a) == 3 for a in got.values())
    assert all(len(set(a)) > 1 for a in got.values()), got


@pytest.mark.parametrize("args, message", [
    (["--samples-per-prompt", "2", "--temperature", "0"], "--samples-per-prompt above 1 needs --temperature > 0"),
    (["--samples-per-prompt", "0", "--temperature", "1"], "--samples-per-prompt must be at least 1, got 0"),
])
def test_samples_per_prompt_is_checked(tmp_path, capsys, args, message):
    prompts = write_prompts(tmp_path / "prompts.jsonl")
    code, _, err = run_cli(["--endpoint", "http://127.0.0.1:9", "--model", "m", "--in", prompts,
                            "--out", tmp_path / "o.jsonl", *args], capsys)
    assert code == regen.EXIT_USAGE
    assert message in err


def test_progress_writes_to_stderr_as_it_is_when_made(monkeypatch):
    """Not sys.stderr as it was at import: an in-process caller redirects it (bench/quality.py's log), and a
    test's capture closed after the import broke every later in-process regen (I/O on a closed file)."""
    import io

    later = io.StringIO()
    monkeypatch.setattr(sys, "stderr", later)
    assert regen.Progress(3).stream is later and not regen.Progress(3).tty

