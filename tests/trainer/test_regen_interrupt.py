"""Ctrl-C (the quality bench's deadline SIGINT) stops `python -m trainer_tools.regen --engine hf`
mid-batch, with either decoder, in a small part of the time the batch would have taken: the
batch in flight is cancelled at its next decode step (its answers would not be written).

On the GPU a 16,384-row batch decoded to its end after the SIGINT and the bench SIGKILLed regen
30 s later (bench/RESULTS.md, 2026-12-06); on the CPU, regen left that batch decoding in a daemon
thread, and the interpreter's shutdown then aborted it (exit -6, not 130)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def conversations(singles: int, doubles: int) -> list[dict]:
    """`singles` one-turn conversations (written after the first batch) and `doubles` two-turn ones
    (their second turns are the next batch)."""
    rows = [{"id": f"s{i}", "messages": [{"role": "user", "content": f"step{i % 7} v{i}"}]} for i in range(singles)]
    rows += [{"id": f"d{i}", "messages": [{"role": "user", "content": f"step{i % 5} w{i}"},
                                          {"role": "assistant", "content": "dropped"},
                                          {"role": "user", "content": f"and then {i}"}]} for i in range(doubles)]
    return rows


def whole_lines(path: Path) -> list[str]:
    """The output's ids; every line whole (newline-terminated JSON), none twice."""
    data = path.read_bytes()
    assert data == b"" or data.endswith(b"\n")
    ids = [json.loads(line)["id"] for line in data.split(b"\n")[:-1]]
    assert len(ids) == len(set(ids))
    return ids


def start(argv: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def test_sigint_mid_batch_exits_130_in_a_fraction_of_the_batch_time_and_a_rerun_resumes(qwen3_model_dir, tmp_path):
    """The greedy run's default decoder (static). The one-turn conversations finish in the first
    batch; the SIGINT comes once one of them is written (a progress line) and the next batch (the
    two-turn conversations' second turns) has started decoding (regen's own line). How long that
    batch would have taken: the rerun, which decodes what the interrupt cut off."""
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "regen.jsonl"
    rows = conversations(64, 64)
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [sys.executable, "-m", "trainer_tools.regen", "--engine", "hf", "--model-path", str(qwen3_model_dir),
            "--in", str(prompts), "--out", str(out), "-n", "128", "--max-tokens", "192", "--progress-every", "0"]
    proc = start(argv)
    try:
        assert proc.stderr is not None
        batches = written = 0
        for line in proc.stderr:
            batches += line.startswith("regen: decoding")
            written += line.startswith("regen [")
            if batches >= 2 and written:
                break
        assert batches >= 2 and written, "regen ended before its second batch"
        proc.send_signal(signal.SIGINT)
        sent = time.monotonic()
        _, rest = proc.communicate(timeout=60)
        stop_s = time.monotonic() - sent
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, rest
    assert "regen: interrupted" in rest and "Traceback" not in rest
    before = whole_lines(out)
    assert before and set(before) <= {f"s{i}" for i in range(64)}  # no two-turn conversation got its second answer

    rerun = start(argv)
    assert rerun.stderr is not None
    decoding = next(time.monotonic() for line in rerun.stderr if line.startswith("regen: decoding"))
    summary, _ = rerun.communicate(timeout=120)
    rest_s = time.monotonic() - decoding
    assert rerun.returncode == 0
    assert f"{128 - len(before)} regenerated, {len(before)} already done" in summary
    assert sorted(whole_lines(out)) == sorted(r["id"] for r in rows)
    assert stop_s < rest_s / 4, f"stopped {stop_s:.2f}s after SIGINT; the rest took {rest_s:.2f}s to decode"


def test_close_cancels_transformers_generate_mid_batch(qwen3_model_dir):
    """Sampled answers decode through transformers' `generate`: close() stops it at its next token
    (a stopping criterion), fails the batch's requests and leaves no generation thread behind."""
    from trainer_tools.regen import HFEngine, RegenError, Sampling

    started = threading.Event()
    engine = HFEngine(str(qwen3_model_dir), Sampling(max_tokens=96, temperature=1.0), batch_size=48,
                      on_batch=lambda rows, width: started.set())
    assert not engine.static
    chats = [[{"role": "user", "content": f"step{i % 7} v{i}"}] for i in range(48)]
    ids = engine.prompt_ids_batch([(c, None) for c in chats])
    engine.generate(ids[:4])  # warm-up
    t0 = time.monotonic()
    assert len(engine.generate(ids)) == 48
    batch_s = time.monotonic() - t0

    outcomes: list[str] = []

    def ask(chat: list[dict]) -> None:
        try:
            outcomes.append(engine.complete(chat).finish_reason)
        except RegenError as e:
            outcomes.append(str(e))

    threads = [threading.Thread(target=ask, args=(c,)) for c in chats]
    for t in threads:
        t.start()
    assert started.wait(30)
    time.sleep(batch_s / 4)  # well into the decode
    t0 = time.monotonic()
    engine.close()
    close_s = time.monotonic() - t0
    for t in threads:
        t.join(30)
    assert close_s < batch_s / 4, f"close took {close_s:.2f}s; the batch took {batch_s:.2f}s"
    assert outcomes == ["the engine is closed"] * 48
    assert not engine._thread.is_alive()
