"""Ctrl-C (the quality bench's deadline SIGINT) stops `python -m trainer_tools.regen --engine hf`
mid-batch: the batch in flight is cancelled at its next decode step (its answers would not be
written), the answers complete by then are written whole, and a rerun resumes.

On the GPU a 16,384-row batch, then a 4,300-row one, decoded to its end after the SIGINT and the bench
SIGKILLed regen 30 s later (bench/RESULTS.md, 2026-12-06; notes of the recipe ablation's first call).
Reproduced on the CPU by delivering the SIGINT to another thread than the main one (the kernel may:
a process-directed signal goes to any thread that does not block it): the main thread, blocked in
an untimed wait for the next answer, ran Python's handler only when that answer came - after the
whole batch in flight had decoded. Progress, not time, is asserted: the decode step regen says it
cancelled at, and which conversations the output holds."""

from __future__ import annotations

import ctypes
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SIGINT_BIT = 1 << (signal.SIGINT - 1)


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
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def sigint_another_thread(pid: int) -> None:
    """SIGINT to one of the process's threads other than the main one (tgkill), one that does not
    block it: where the kernel may deliver a `kill`."""
    for tid in sorted((int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid), reverse=True):
        try:
            status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        except FileNotFoundError:  # the thread ended
            continue
        blocked = int(re.search(r"^SigBlk:\s*([0-9a-f]+)", status, re.M).group(1), 16)
        if not blocked & SIGINT_BIT:
            if ctypes.CDLL(None, use_errno=True).tgkill(pid, tid, signal.SIGINT) == 0:
                return
    raise AssertionError(f"no thread of {pid} besides the main one takes SIGINT")


@pytest.mark.parametrize("to", ["the process", "another thread"])
def test_sigint_mid_batch_cancels_the_batch_at_its_next_step_and_a_rerun_resumes(qwen3_model_dir, tmp_path, to):
    """The greedy run's default decoder (static). The one-turn conversations (16: the first batch only
    has to write one) finish in the first batch; the SIGINT comes once one of them is written (a
    progress line) and the next batch (the two-turn conversations' second turns, 191 decode steps)
    has started decoding (regen's own line). regen says at which step it cancelled that batch: before
    its end, and no two-turn conversation is written; the rerun (after the process-directed SIGINT)
    writes exactly the rest."""
    prompts, out = tmp_path / "prompts.jsonl", tmp_path / "regen.jsonl"
    rows = conversations(16, 64)
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = [sys.executable, "-m", "trainer_tools.regen", "--engine", "hf", "--model-path", str(qwen3_model_dir),
            "--in", str(prompts), "--out", str(out), "-n", "80", "--max-tokens", "192", "--progress-every", "0"]
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
        if to == "the process":
            proc.send_signal(signal.SIGINT)
        else:
            sigint_another_thread(proc.pid)
        _, rest = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 130, rest
    assert "Traceback" not in rest
    before = whole_lines(out)
    assert before and set(before) <= {f"s{i}" for i in range(16)}  # no two-turn conversation got its second answer
    cancelled = re.search(r"regen: interrupted: cancelled a batch of (\d+) conversations at decode step (\d+) of (\d+)",
                          rest)
    assert cancelled, rest
    assert int(cancelled[1]) == 64 and int(cancelled[3]) == 192 and int(cancelled[2]) < 191
    if to != "the process":
        return  # the rerun reads only the output, whole and the same in both cases (asserted above): resumed once

    rerun = start(argv)
    summary, _ = rerun.communicate(timeout=120)
    assert rerun.returncode == 0
    assert f"{80 - len(before)} regenerated, {len(before)} already done" in summary
    assert sorted(whole_lines(out)) == sorted(r["id"] for r in rows)


def test_close_cancels_transformers_generate_mid_batch(qwen3_model_dir):
    """Answers decoded through transformers' `generate` (`--decode hf`, and any model the static decoder
    does not run): close() stops it at its next token (a stopping criterion), fails the batch's requests
    and leaves no generation thread behind."""
    from trainer_tools.regen import HFEngine, RegenError, Sampling

    started = threading.Event()
    engine = HFEngine(str(qwen3_model_dir), Sampling(max_tokens=96, temperature=1.0), batch_size=48, decode="hf",
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
