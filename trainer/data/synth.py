"""Synthetic conversations whose answers are deterministic, so a tiny target and a drafter can learn them.

The user names a rule and a start value ("step3 v17"); the assistant answers with the
arithmetic walk v(17+3), v(17+6), ... modulo NUM_VALUES, of a random length. The next token
depends on the rule (in context) and the last value, so a drafter can predict whole blocks.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from trainer.run.contract import named_for

NUM_VALUES = 32
RULES = {"step1": 1, "step3": 3, "step7": 7}


def synthetic_words() -> list[str]:
    return list(RULES) + [f"v{i}" for i in range(NUM_VALUES)]


def synthetic_conversation(rng: random.Random, min_len: int, max_len: int) -> dict:
    rule = rng.choice(sorted(RULES))
    start = rng.randrange(NUM_VALUES)
    n = rng.randint(min_len, max_len)
    walk = [f"v{(start + RULES[rule] * (i + 1)) % NUM_VALUES}" for i in range(n)]
    return {"messages": [
        {"role": "user", "content": f"{rule} v{start}"},
        {"role": "assistant", "content": " ".join(walk)},
    ]}


def synthetic_conversations(n: int, seed: int, min_len: int = 12, max_len: int = 40) -> list[dict]:
    rng = random.Random(seed)
    return [synthetic_conversation(rng, min_len, max_len) for _ in range(n)]


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    """Write rows as JSONL atomically (tmp + fsync + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # a full disk: no half file left, and the error names the user's path
        tmp.unlink(missing_ok=True)
        raise named_for(e, tmp, path) from None
    return path
