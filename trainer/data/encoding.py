"""Tokenizing many conversations on the machine's cores (data.workers).

encode_conversation renders the chat template four or more times a conversation and tokenizes
with offsets: ~2 ms for Qwen3, so 32,768 conversations took ~80 s in one process on a 16-core
H200 host, before the trainer's first log line. From PARALLEL_FROM conversations on, they are
encoded in worker processes, a chunk of conversations per task, results taken in input order:
each conversation goes through the same function as in one process, so ids and masks are
identical, and the first bad conversation in input order is the one reported, with the message
one process gives (file:line: what is wrong).

Workers are spawned, never forked: the trainer may already hold CUDA state and threads when it
reads its data, and a forked child of such a process can hang on a lock another thread held.
A spawned worker loads the tokenizer from a temporary directory the trainer saves it to once
(save_pretrained: tokenizer.json, settings, chat template), not from a pickle: nothing in the
trainer unpickles (tests/trainer/test_export_destination.py); with the trainer's own tokenizer class
where transformers has it, not through AutoTokenizer, whose import pulls in torch (1.3 CPU-seconds
to a worker's first conversation instead of 2.8). Starting one costs about a second (importing
transformers), which is why small data stays in one process.

A worker dies with the trainer, however the trainer ends (SIGKILL, an OOM kill included): the pool's
queues are pipes every worker holds both ends of, so a worker whose parent is gone would wait on them
forever. Each asks the kernel for SIGKILL when its parent goes (PR_SET_PDEATHSIG) and, where that is
not available or came too late, watches its parent pid.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from trainer.data.chat import DataError, encode_conversation, template_kwargs_for, weighted_answer

PARALLEL_FROM = 2000  # conversations; fewer are encoded in this process (workers cost ~1 s to start)
AUTO_MAX = 16  # data.workers auto: at most this many processes
TASKS_PER_WORKER = 8  # chunks per worker: a slow chunk does not leave the others idle at the end
MAX_CHUNK = 1024  # conversations per task

Encoded = tuple[list[int], list[float], int]  # ids, loss mask (both cut at max_length; 0/1, or weights), untruncated length


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask: a container's or taskset's share)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def process_count(workers: int | str, conversations: int) -> int:
    """Processes that encode `conversations` under data.workers (`auto` or a count): 1 below
    PARALLEL_FROM conversations; auto is min(usable CPUs, AUTO_MAX)."""
    wanted = min(usable_cpus(), AUTO_MAX) if workers == "auto" else int(workers)
    if conversations < PARALLEL_FROM or wanted <= 1:
        return 1
    return min(wanted, conversations)


def encode_each(tokenizer: Any, conversations: list[dict], max_length: int,
                template_kwargs: dict | None = None, progress: Callable[[int], None] | None = None) -> list[Encoded]:
    """encode_conversation on each conversation in order, rendered with its own tools
    (chat.template_kwargs_for); a DataError names its source (file:line). progress(n): n encoded so far."""
    out = []
    for c in conversations:
        try:
            out.append(encode_conversation(tokenizer, c["messages"], max_length, template_kwargs_for(c, template_kwargs),
                                           weighted_answer(c)))
        except DataError as exc:
            raise DataError(f"{c['source']}: {exc}" if "source" in c else str(exc)) from None
        if progress is not None and (len(out) % 256 == 0 or len(out) == len(conversations)):
            progress(len(out))
    return out


def encode_all(tokenizer: Any, conversations: list[dict], max_length: int, template_kwargs: dict | None = None,
               processes: int = 1, progress: Callable[[int], None] | None = None) -> list[Encoded]:
    """Every conversation encoded (see encode_each), in input order, by `processes` processes
    (see process_count); 1 runs here."""
    if processes <= 1 or len(conversations) < 2:
        return encode_each(tokenizer, conversations, max_length, template_kwargs, progress)
    size = max(1, min(MAX_CHUNK, -(-len(conversations) // (processes * TASKS_PER_WORKER))))
    chunks = [conversations[i:i + size] for i in range(0, len(conversations), size)]
    out: list[Encoded] = []
    with tempfile.TemporaryDirectory(prefix="dflash-tokenizer-") as saved:
        tokenizer.save_pretrained(saved)
        with ProcessPoolExecutor(min(processes, len(chunks)), mp_context=multiprocessing.get_context("spawn"),
                                 initializer=_start_worker,
                                 initargs=(saved, max_length, template_kwargs, os.getpid(),
                                           str(getattr(tokenizer, "name_or_path", "") or ""),
                                           (type(tokenizer).__module__, type(tokenizer).__qualname__))) as pool:
            try:
                for part in pool.map(_encode_chunk, chunks):  # in order: the first failing chunk raises first
                    out.extend(part)
                    if progress is not None:
                        progress(len(out))
            except BaseException as exc:  # a bad conversation, Ctrl-C: the chunks not started are dropped
                pool.shutdown(cancel_futures=True)
                if isinstance(exc, DataError):  # the worker's message, without its remote traceback
                    raise DataError(str(exc)) from None
                raise
    return out


_worker: tuple[Any, int, dict | None] | None = None  # a worker's (tokenizer, max_length, template kwargs)


PR_SET_PDEATHSIG = 1  # linux/prctl.h
PARENT_POLL_S = 1.0


def die_with_parent(parent: int) -> None:
    """End this process when `parent` (the pid that started it) ends: SIGKILL from the kernel on
    Linux, and a thread that watches the parent pid everywhere (the kernel's signal follows the
    thread that started the process; a parent gone before this call is caught here too)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux
        pass
    if os.getppid() != parent:
        os._exit(1)

    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent:  # reparented: the trainer is gone
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _start_worker(saved: str, max_length: int, template_kwargs: dict | None, parent: int, source: str,
                  kind: tuple[str, str]) -> None:
    """The worker's tokenizer, from the directory the trainer saved it to, of the trainer's tokenizer
    class (`kind`: its module and name; AutoTokenizer where that is not one of transformers' own),
    named after the one the trainer read it from (`source`: its name_or_path), so its chat template's
    errors name that one (trainer.data.chat.template_source)."""
    die_with_parent(parent)
    import importlib

    global _worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the trainer, which ends the pool
    module, name = kind
    if module.startswith("transformers.") and "." not in name:
        cls = getattr(importlib.import_module(module), name)
    else:  # not one of transformers' classes (a model's own code): as the saved directory names it
        from transformers import AutoTokenizer as cls
    tokenizer = cls.from_pretrained(saved, local_files_only=True)
    tokenizer.name_or_path = source
    _worker = (tokenizer, max_length, template_kwargs)


def _encode_chunk(conversations: list[dict]) -> list[Encoded]:
    assert _worker is not None, "the pool's initializer sets the worker's tokenizer"
    tokenizer, max_length, template_kwargs = _worker
    return encode_each(tokenizer, conversations, max_length, template_kwargs)
