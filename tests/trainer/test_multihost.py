"""Across hosts, the parts: host shards of the data, the distributed config section, the launcher.

Two real ranks (torchrun, c10d rendezvous, gloo) on two netns nodes through `dflash-ops run
start`, with the same-losses / kill -9 / resume promises: tests/integration/test_multinode_runs.py.
"""
from __future__ import annotations

import pytest

from tests.trainer.tiny_config import two_host_config
from trainer.distributed.launch import describe_exit, interface_of
from trainer.distributed.multihost import HostShard
from trainer.run.config import ConfigError, parse_config


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
    with pytest.raises(ConfigError, match=r"<config>:\d+: distributed.backend must be one of .auto., .nccl., .gloo."):
        parse_config(two_host_config(4, "distributed: {backend: mpi}"))
    with pytest.raises(ConfigError, match=r"peer_timeout_s must be in \(0, 25\]"):
        parse_config(two_host_config(4, "distributed: {peer_timeout_s: 60}"))


def test_launcher_helpers():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.77") is None
    assert describe_exit(-9) == "killed by signal 9 (SIGKILL)"
    assert describe_exit(3) == "exited with status 3"
