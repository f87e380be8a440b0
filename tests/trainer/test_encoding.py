"""Tokenizing in worker processes (trainer.data.encoding): the same ids, masks and errors as one process."""

import json

import pytest
from transformers import AutoTokenizer

from trainer.data import encoding
from trainer.data.batches import build_dataset
from trainer.data.chat import SENTINEL, DataError, read_conversations, tokenize_conversation
from trainer.data.synth import synthetic_conversations, synthetic_words
from trainer.data.tokenizer import synthetic_tokenizer


def _code_conversations(n):
    """The quality bench's kind of data: a code prefix from the user, its continuation as the answer."""
    lines = [line for line in open(encoding.__file__.replace("encoding.py", "chat.py")).read().splitlines() if line]
    return [{"messages": [{"role": "user", "content": "\n".join(lines[i % 200:i % 200 + 6])},
                          {"role": "assistant", "content": "\n".join(lines[i % 200 + 6:i % 200 + 9])}],
             "source": f"code.jsonl:{i + 1}"} for i in range(n)]


def test_workers_give_the_ids_masks_and_lengths_of_one_process(qwen3_model_dir):
    tok = synthetic_tokenizer(synthetic_words())
    conversations = synthetic_conversations(300, 0, 4, 40)
    one = encoding.encode_all(tok, conversations, 32, None, processes=1)
    assert encoding.encode_all(tok, conversations, 32, None, processes=2) == one
    assert [(ids, mask) for ids, mask, _ in one] == [tokenize_conversation(tok, c["messages"], 32) for c in conversations]
    assert any(length > 32 for _, _, length in one)  # some were cut: the untruncated length crosses too
    # a hub tokenizer (byte-level BPE, Qwen3 template) with template kwargs reaches the workers whole
    qwen = AutoTokenizer.from_pretrained(qwen3_model_dir, local_files_only=True)
    code, kwargs = _code_conversations(200), {"enable_thinking": False}
    one = encoding.encode_all(qwen, code, 256, kwargs, processes=1)
    assert encoding.encode_all(qwen, code, 256, kwargs, processes=3) == one
    assert one != encoding.encode_all(qwen, code, 256, None, processes=1)  # the kwargs matter to the masks
    a = build_dataset(qwen, code, 256, [128, 256], 1024, 0, 16, kwargs, processes=1)
    b = build_dataset(qwen, code, 256, [128, 256], 1024, 0, 16, kwargs, processes=2)
    assert a.samples == b.samples and a.plan_epoch(0) == b.plan_epoch(0)


def test_a_bad_conversation_in_the_middle_reads_as_in_one_process():
    """The first bad conversation in input order is named, with the same message, as a DataError
    without the workers' traceback chained to it."""
    tok = synthetic_tokenizer(synthetic_words())
    conversations = synthetic_conversations(300, 0, 4, 40)
    for i, c in enumerate(conversations):
        c["source"] = f"train.jsonl:{i + 1}"
    for i in (150, 260):  # a later bad one must not be the one reported
        conversations[i]["messages"][-1]["content"] += " " + SENTINEL
    with pytest.raises(DataError) as sequential:
        encoding.encode_all(tok, conversations, 64, None, processes=1)
    with pytest.raises(DataError) as parallel:
        encoding.encode_all(tok, conversations, 64, None, processes=2)
    assert str(sequential.value).startswith("train.jsonl:151: cannot locate assistant turn")
    assert str(parallel.value) == str(sequential.value)
    assert parallel.value.__cause__ is None and parallel.value.__suppress_context__


def test_process_count_follows_data_workers(monkeypatch):
    monkeypatch.setattr(encoding, "usable_cpus", lambda: 64)
    assert encoding.process_count("auto", 100_000) == encoding.AUTO_MAX
    assert encoding.process_count(4, 100_000) == 4
    assert encoding.process_count("auto", encoding.PARALLEL_FROM - 1) == 1  # small data: no workers to start
    assert encoding.process_count(1, 100_000) == 1
    monkeypatch.setattr(encoding, "usable_cpus", lambda: 1)
    assert encoding.process_count("auto", 100_000) == 1


def test_one_process_starts_no_workers(monkeypatch):
    def no_pool(*args, **kwargs):
        raise AssertionError("data.workers 1 started a process pool")

    monkeypatch.setattr(encoding, "ProcessPoolExecutor", no_pool)
    tok = synthetic_tokenizer(synthetic_words())
    conversations = synthetic_conversations(50, 0, 4, 40)
    assert encoding.encode_all(tok, conversations, 64, None, processes=1) == [
        (*tokenize_conversation(tok, c["messages"], 64), len(tokenize_conversation(tok, c["messages"], 10**6)[0]))
        for c in conversations]


def _run(qwen3_model_dir, tmp_path, data, workers):
    from trainer.entry import train
    from trainer.run.config import parse_config

    cfg = parse_config(f"model: {{target: {{path: {qwen3_model_dir}}}, drafter_layers: 1, block_size: 4, dtype: fp32}}\n"
                       f"data: {{train_path: {data}, max_length: 64, token_budget: 128, bucket_edges: [64],"
                       f" num_anchors: 2, pad_multiple: 16, workers: {workers}}}\n"
                       f"optim: {{total_steps: 1}}\nrun: {{threads: 1}}\n")
    run = tmp_path / f"run{workers}"
    assert train(cfg, run) == 1
    return json.loads((run / "status.json").read_text())["error"], (run / "train.log").read_text()


def test_a_run_with_a_bad_conversation_fails_in_one_line_with_workers(qwen3_model_dir, tmp_path, monkeypatch):
    """A DataError raised in a worker ends the run as one in the trainer's process does: `data
    error: file:line: ...`, no traceback."""
    rows = [{"prompt": f"what is {i} plus {i}?", "response": f"{2 * i}."} for i in range(40)]
    rows[25]["response"] += SENTINEL
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(read_conversations(data)) == 40
    monkeypatch.setattr(encoding, "PARALLEL_FROM", 10)
    (one, _), (two, log) = (_run(qwen3_model_dir, tmp_path, data, w) for w in (1, 2))
    assert two == one
    assert two["message"] == f"data error: {data}:26: cannot locate assistant turn 1: the chat template does not " \
                             "render its content" and two["traceback"] is None
    failed = [line for line in log.splitlines() if "FAILED" in line]
    assert len(failed) == 1 and "data error: " in failed[0]


ENCODES_A_LONG_TIME = """
from trainer.data import encoding
from trainer.data.synth import synthetic_conversations, synthetic_words
from trainer.data.tokenizer import synthetic_tokenizer

encoding.encode_all(synthetic_tokenizer(synthetic_words()), synthetic_conversations(100000, 0, 4, 40), 32, None,
                    processes=2)
"""


@pytest.mark.slow
def test_the_workers_die_with_a_trainer_that_is_killed(tmp_path):
    """SIGKILL (an OOM kill, `run stop --kill`) of the process whose workers tokenise: they used to
    wait on the pool's pipes forever, holding memory and CPUs."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from tests.procs import alive, session_members

    root = Path(encoding.__file__).resolve().parents[2]
    parent = subprocess.Popen([sys.executable, "-c", ENCODES_A_LONG_TIME], cwd=root, start_new_session=True,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        workers: list[int] = []
        while len(workers) < 2 and time.monotonic() < deadline and parent.poll() is None:
            time.sleep(0.2)
            workers = [p for p in session_members(parent.pid) if p != parent.pid
                       and b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(workers) == 2, f"the two workers never started (trainer exit {parent.poll()})"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 30
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [w for w in workers if alive(w)], "workers outlived their trainer"
    finally:
        for pid in session_members(parent.pid):
            os.kill(pid, signal.SIGKILL)
        parent.kill()
