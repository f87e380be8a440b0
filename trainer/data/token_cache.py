"""Tokenized conversations kept on disk (data.token_cache), so a run's next start, or another run on the same
data, does not tokenize them again.

Tokenizing is ~2 ms a conversation (trainer.data.encoding): 13 s for 32,768 on 16 processes of an H100 host,
~7 minutes a start for a million, and three runs starting at once on one host each took three times that.
An entry is keyed by everything the encoding depends on: the conversations (their content, in order), the
tokenizer (its vocabulary and merges, special tokens, chat template), max_length, the chat-template
arguments, and the source of the code that encodes (a changed trainer never reads an older entry). A run that
finds its key loads the entry; one that does not encodes and writes it whole (a temporary file renamed into
place: a reader sees the old entry, the new one, or none, never a part). Runs starting at once on the same
data take the entry's lock in turn: the first encodes, the others load what it wrote.

Nothing here deletes: an entry is one file `<key>.npz` and its lock file, written by this module only.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data import chat, encoding
from trainer.data.chat import DataError
from trainer.data.encoding import Encoded

FORMAT = 1


def code_digest() -> str:
    """The encoding code's source (chat templates and masks, the workers): an entry written by other code
    is another key."""
    h = hashlib.sha256()
    for module in (chat, encoding):
        h.update(Path(str(module.__file__)).read_bytes())
    return h.hexdigest()


def tokenizer_digest(tokenizer: Any) -> str:
    """What the tokenizer encodes with: a fast tokenizer's whole definition (tokenizer.json's content), else
    its vocabulary; its special tokens, chat template and class."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    definition = backend.to_str() if backend is not None else json.dumps(tokenizer.get_vocab(), sort_keys=True)
    h = hashlib.sha256(definition.encode())
    h.update(json.dumps([type(tokenizer).__qualname__, getattr(tokenizer, "chat_template", None),
                         str(getattr(tokenizer, "special_tokens_map", None)),
                         getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)],
                        sort_keys=True, default=str).encode())
    return h.hexdigest()


def cache_key(tokenizer: Any, conversations: list[dict], max_length: int, template_kwargs: dict | None) -> str:
    h = hashlib.sha256(json.dumps({"format": FORMAT, "code": code_digest(), "tokenizer": tokenizer_digest(tokenizer),
                                   "max_length": max_length, "template_kwargs": template_kwargs},
                                  sort_keys=True, default=str).encode())
    for c in conversations:  # not where it was read from (`source`, file:line for errors): a copy of the data is the same
        h.update(json.dumps({k: v for k, v in c.items() if k != "source"}, sort_keys=True, default=str).encode())
        h.update(b"\n")
    return h.hexdigest()[:40]


def write_entry(path: Path, encoded: list[Encoded]) -> None:
    """The encoded conversations as flat arrays: ids (int32), 0/1 loss masks (uint8), and the float weights
    (float32, the precision the batches hold them in) of the conversations that weigh their tokens
    (`weighted`: their masks are floats, the others' 0/1 ints); each conversation's length and untruncated
    length."""
    lengths = np.array([len(ids) for ids, _, _ in encoded], dtype=np.int64)
    weighted = np.array([bool(mask) and isinstance(mask[0], float) for _, mask, _ in encoded], dtype=bool)
    tokens = int(lengths.sum())
    ids = np.fromiter((t for row, _, _ in encoded for t in row), dtype=np.int32, count=tokens)
    masks = np.fromiter((m > 0 for _, mask, _ in encoded for m in mask), dtype=np.uint8, count=tokens)
    weights = np.fromiter((m for (_, mask, _), w in zip(encoded, weighted) if w for m in mask), dtype=np.float32)
    full = np.array([n for _, _, n in encoded], dtype=np.int64)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, ids=ids, masks=masks, weights=weights, lengths=lengths, weighted=weighted, full=full)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def read_entry(path: Path) -> list[Encoded] | None:
    """The entry's conversations, or None where it is missing or cannot be read whole."""
    try:
        with np.load(path) as z:
            ids, masks, weights = z["ids"].tolist(), z["masks"].tolist(), z["weights"].tolist()
            lengths, weighted, full = z["lengths"].tolist(), z["weighted"].tolist(), z["full"].tolist()
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
        return None
    if not len(ids) == len(masks) == sum(lengths) or not len(weighted) == len(full) == len(lengths) \
            or len(weights) != sum(n for n, w in zip(lengths, weighted) if w):
        return None
    out: list[Encoded] = []
    start = weight = 0
    for n, w, untruncated in zip(lengths, weighted, full):
        if w:
            mask: list = weights[weight:weight + n]
            weight += n
        else:
            mask = masks[start:start + n]
        out.append((ids[start:start + n], mask, untruncated))
        start += n
    return out


def cached_encode(directory: str | Path, tokenizer: Any, conversations: list[dict], max_length: int,
                  template_kwargs: dict | None, encode: Callable[[], list[Encoded]]) -> tuple[list[Encoded], bool]:
    """(encode()'s result for these conversations, whether it was read from the cache directory's entry):
    read where the directory has one, else encoded and written there."""
    root = Path(directory)
    key = cache_key(tokenizer, conversations, max_length, template_kwargs)
    path = root / f"{key}.npz"
    try:
        root.mkdir(parents=True, exist_ok=True)
        lock = open(root / f".{key}.lock", "a")
    except OSError as e:  # before any encoding: a cache that cannot be written is said at once
        raise DataError(f"data.token_cache {root}: {e.strerror or e}") from None
    with lock:  # the lock goes with the file's close
        fcntl.flock(lock, fcntl.LOCK_EX)
        found = read_entry(path) if path.exists() else None
        if found is not None and len(found) == len(conversations):
            return found, True
        encoded = encode()
        try:
            write_entry(path, encoded)
        except OSError as e:
            raise DataError(f"data.token_cache {root}: the entry could not be written: {e.strerror or e}") from None
        return encoded, False
