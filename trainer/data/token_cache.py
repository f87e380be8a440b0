"""Tokenized conversations kept on disk (data.token_cache), so a run's next start, or another run on the same
data, does not tokenize them again.

Tokenizing is ~2 ms a conversation (trainer.data.encoding): 13 s for 32,768 on 16 processes of an H100 host,
~7 minutes a start for a million, and runs starting at once on one host share its cores. An entry is keyed
by everything the encoding depends on: the conversations (their content, in order), the tokenizer (its
vocabulary and merges, special tokens, chat template), max_length, the chat-template arguments, the source of
the code that encodes and the transformers and tokenizers versions that render and tokenize (an upgraded
trainer never reads an older entry). A run that
finds its key loads the entry; one that does not encodes and writes it whole (a temporary file renamed into
place: a reader sees the old entry, the new one, or none, never a part). Runs starting at once on the same
data take the entry's lock in turn: the first encodes, the others load what it wrote.

Nothing here deletes: an entry is one file `<key>.tokens` and its lock file, written by this module only.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import sys
from array import array
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

from trainer.data import chat, encoding
from trainer.data.chat import DataError
from trainer.data.encoding import Encoded
from trainer.run.contract import write_atomic

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
                                   "libraries": [version("transformers"), version("tokenizers"), sys.byteorder],
                                   "max_length": max_length, "template_kwargs": template_kwargs},
                                  sort_keys=True, default=str).encode())
    for c in conversations:  # not where it was read from (`source`, file:line for errors): a copy of the data is the same
        h.update(json.dumps({k: v for k, v in c.items() if k != "source"}, sort_keys=True, default=str).encode())
        h.update(b"\n")
    return h.hexdigest()[:40]


MAGIC = b"dflash-token-cache\n"
# the arrays of an entry after its header, in this order: (name, array typecode)
ARRAYS = (("lengths", "q"), ("full", "q"), ("weighted", "B"), ("ids", "i"), ("masks", "B"), ("weights", "f"))


def write_entry(path: Path, encoded: list[Encoded]) -> None:
    """The encoded conversations as flat arrays after a one-line JSON header (their sizes and the payload's
    sha256): each conversation's length and untruncated length, whether it weighs its tokens (`weighted`:
    its mask is floats, the others' 0/1 ints), the ids (int32), the 0/1 masks (uint8), and the weighted
    conversations' weights (float32, the precision the batches hold them in)."""
    weighted = [bool(mask) and isinstance(mask[0], float) for _, mask, _ in encoded]
    values = {
        "lengths": (len(ids) for ids, _, _ in encoded),
        "full": (n for _, _, n in encoded),
        "weighted": weighted,
        "ids": (t for ids, _, _ in encoded for t in ids),
        "masks": (m > 0 for _, mask, _ in encoded for m in mask),
        "weights": (m for (_, mask, _), w in zip(encoded, weighted) if w for m in mask),
    }
    arrays = {name: array(code, values[name]) for name, code in ARRAYS}  # each array's type named once, in ARRAYS
    payload = b"".join(arrays[name].tobytes() for name, _ in ARRAYS)
    header = {"sizes": {name: len(arrays[name]) for name, _ in ARRAYS}, "sha256": hashlib.sha256(payload).hexdigest()}
    write_atomic(path, MAGIC + json.dumps(header).encode() + b"\n" + payload)


def read_entry(path: Path) -> list[Encoded] | None:
    """The entry's conversations, or None where it cannot be read whole (cut short, damaged, not an entry)."""
    try:
        data = path.read_bytes()
        if not data.startswith(MAGIC):
            return None
        line_end = data.index(b"\n", len(MAGIC))
        header = json.loads(data[len(MAGIC):line_end])
        payload = memoryview(data)[line_end + 1:]
        if hashlib.sha256(payload).hexdigest() != header["sha256"]:
            return None
        arrays, at = {}, 0
        for name, code in ARRAYS:
            a = array(code)
            size = int(header["sizes"][name]) * a.itemsize
            a.frombytes(payload[at:at + size])
            arrays[name], at = a.tolist(), at + size
    except (OSError, ValueError, KeyError, TypeError):
        return None
    lengths, weighted, ids, masks, weights = (arrays[k] for k in ("lengths", "weighted", "ids", "masks", "weights"))
    if at != len(payload) or not len(ids) == len(masks) == sum(lengths) \
            or not len(weighted) == len(arrays["full"]) == len(lengths) \
            or len(weights) != sum(n for n, w in zip(lengths, weighted) if w):
        return None
    out: list[Encoded] = []
    start = weight = 0
    for n, w, untruncated in zip(lengths, weighted, arrays["full"]):
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
    path = root / f"{key}.tokens"
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
