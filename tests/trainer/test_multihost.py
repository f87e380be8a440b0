"""Across hosts, the parts: host shards of the data, the distributed config section, the launcher.

Two real ranks (torchrun, c10d rendezvous, gloo) on two netns nodes through `dflash-ops run
start`, with the same-losses / kill -9 / resume promises: tests/integration/test_multinode_runs.py.
"""
from __future__ import annotations

import pytest

from trainer.config import ConfigError, parse_config
from trainer.launch import describe_exit, interface_of
from trainer.pipeline.multihost import HostShard

CONFIG = """
model:
  target:
    tiny: {layers: 2, hidden: 32, heads: 4, kv_heads: 2, head_dim: 8, intermediate: 64, fit_steps: 0}
  drafter_layers: 1
  block_size: 4
  num_target_layers: 2
  dtype: fp32
  loss_chunk: 256
data:
  synthetic: {n_train: 64, n_eval: 2, seed: 0, min_len: 8, max_len: 30}
  max_length: 64
  num_anchors: 4
  token_budget: 128
  bucket_edges: [32, 64]
  pad_multiple: 16
optim: {lr: 0.003, total_steps: %(steps)d, micro_batches: 2}
run: {log_every: 1, threads: 1, checkpoint_every: 5}
eval: {samples: 1, max_new_tokens: 4}
pipeline: {kind: threaded}
distributed: {peer_timeout_s: 5}
"""


def test_host_shards_split_the_global_sequence_in_order():
    drawn = iter(range(100))
    prepared = []

    def prepare(b):
        prepared.append(b)
        return f"blocks{b}"

    shards = [HostShard(lambda: next(drawn), prepare, rank, 3) for rank in range(3)]
    got = [(shards[r].next(), r) for _ in range(2) for r in range(3)]
    # each call draws (and prepares, so the anchor generator advances) one batch per host
    assert [b for b, _ in got] == [0, 4, 8, 9, 13, 17]
    assert prepared == list(range(18))
    assert shards[1].blocks(4) == "blocks4"


def test_distributed_section_is_validated():
    text = (CONFIG % {"steps": 4}).replace("distributed: {peer_timeout_s: 5}", "distributed: {backend: mpi}")
    with pytest.raises(ConfigError, match=r"<config>:\d+: distributed.backend must be auto, nccl or gloo"):
        parse_config(text)
    text = (CONFIG % {"steps": 4}).replace("peer_timeout_s: 5", "peer_timeout_s: 60")
    with pytest.raises(ConfigError, match=r"peer_timeout_s must be in \(0, 25\]"):
        parse_config(text)


def test_launcher_helpers():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.77") is None
    assert describe_exit(-9) == "killed by signal 9 (SIGKILL)"
    assert describe_exit(3) == "exited with status 3"
