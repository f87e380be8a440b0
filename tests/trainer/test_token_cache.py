"""data.token_cache: tokenized conversations kept on disk are read back exactly as encoded (weights and 0/1
masks alike), under a key that changes with anything the encoding depends on; a damaged entry is encoded
again; runs starting at once encode once; a run's next start reads them."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.trainer.test_loss_weights import MESSAGES, weighted_row
from tests.trainer.test_run import config, events
from trainer.data.encoding import encode_all
from trainer.data.synth import synthetic_conversations, synthetic_words
from trainer.data.token_cache import cache_key, cached_encode
from trainer.data.tokenizer import synthetic_tokenizer
from trainer.entry import train


@pytest.fixture(scope="module")
def tok():
    return synthetic_tokenizer(synthetic_words())


def conversations(tok):
    return [weighted_row(tok, [1.0, 2.5, 0.5]), {"messages": MESSAGES, "source": "a.jsonl:2"},
            *synthetic_conversations(20, 0, 4, 30)]


class Counting:
    """encode() for cached_encode, counting its calls."""

    def __init__(self, tok, convs, max_length=100, delay_s=0.0):
        self.tok, self.convs, self.max_length, self.delay_s, self.calls = tok, convs, max_length, delay_s, 0

    def __call__(self):
        self.calls += 1
        time.sleep(self.delay_s)
        return encode_all(self.tok, self.convs, self.max_length)


def test_an_entry_reads_back_what_was_encoded_and_a_second_start_does_not_encode(tok, tmp_path):
    convs = conversations(tok)
    encode = Counting(tok, convs)
    first, found = cached_encode(tmp_path, tok, convs, 100, None, encode)
    assert not found and encode.calls == 1
    again, found = cached_encode(tmp_path, tok, convs, 100, None, encode)
    assert found and encode.calls == 1
    assert again == first == encode_all(tok, convs, 100)
    # the weighted row keeps float weights, the others 0/1 ints (the batches' mask dtype follows them)
    assert isinstance(again[0][1][-1], float) and {type(m) for m in again[1][1]} == {int}
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == [f"{cache_key(tok, convs, 100, None)}.tokens"]


def test_the_key_changes_with_what_the_encoding_depends_on_and_not_with_where_rows_were_read(tok):
    convs = conversations(tok)
    key = cache_key(tok, convs, 100, None)
    edited = json.loads(json.dumps(convs))
    edited[5]["messages"][-1]["content"] += " v1"
    moved = [{**c, "source": "elsewhere.jsonl:9"} for c in convs]
    assert cache_key(tok, moved, 100, None) == key
    assert len({key, cache_key(tok, edited, 100, None), cache_key(tok, convs[::-1], 100, None),
                cache_key(tok, convs, 64, None), cache_key(tok, convs, 100, {"enable_thinking": False})}) == 5
    other = synthetic_tokenizer(synthetic_words())
    other.chat_template = (other.chat_template or "") + " "
    assert cache_key(other, convs, 100, None) != key


def test_a_damaged_entry_is_encoded_again_and_replaced(tok, tmp_path):
    convs = conversations(tok)
    encode = Counting(tok, convs)
    cached_encode(tmp_path, tok, convs, 100, None, encode)
    entry = tmp_path / f"{cache_key(tok, convs, 100, None)}.tokens"
    entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])  # a copy cut short
    out, found = cached_encode(tmp_path, tok, convs, 100, None, encode)
    assert not found and encode.calls == 2 and out == encode_all(tok, convs, 100)
    assert cached_encode(tmp_path, tok, convs, 100, None, encode) == (out, True)


def test_runs_starting_at_once_on_the_same_data_encode_it_once(tok, tmp_path):
    convs = conversations(tok)
    encode = Counting(tok, convs, delay_s=0.3)
    results = []
    threads = [threading.Thread(target=lambda: results.append(cached_encode(tmp_path, tok, convs, 100, None, encode)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert encode.calls == 1 and sorted(found for _, found in results) == [False, True, True]
    assert len({json.dumps(out) for out, _ in results}) == 1


def test_a_run_with_a_token_cache_reads_it_on_its_next_start_and_trains_the_same(tmp_path):
    cfg = config(steps=4, every=2)
    cfg.data.token_cache = str(tmp_path / "tokenized")
    assert train(cfg, tmp_path / "a") == 0
    log = (tmp_path / "a" / "train.log").read_text()
    assert f"kept in data.token_cache {tmp_path / 'tokenized'}" in log
    cfg = config(steps=4, every=2)
    cfg.data.token_cache = str(tmp_path / "tokenized")
    assert train(cfg, tmp_path / "b") == 0  # another run directory, the same data
    log = (tmp_path / "b" / "train.log").read_text()
    assert "read 64 training and 2 held-out tokenized conversations from data.token_cache" in log
    assert [e["loss"] for e in events(tmp_path / "b", "step")] == [e["loss"] for e in events(tmp_path / "a", "step")]


def test_a_cache_directory_that_cannot_be_one_is_refused_before_any_encoding(tok, tmp_path):
    from trainer.data.chat import DataError
    from trainer.run.config import ConfigError, parse_config

    convs = conversations(tok)
    encode = Counting(tok, convs)
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(DataError, match=f"data.token_cache {tmp_path / 'file'}: "):
        cached_encode(tmp_path / "file", tok, convs, 100, None, encode)
    assert encode.calls == 0
    good = "model:\n  target:\n    tiny: {layers: 2}\ndata:\n  synthetic: {n_train: 8}\n"
    assert parse_config(good + "  token_cache: /tmp/tokenized\n").data.token_cache == "/tmp/tokenized"
    with pytest.raises(ConfigError, match=":6: data.token_cache must be a directory path or null"):
        parse_config(good + "  token_cache: ''\n")
