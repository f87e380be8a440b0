"""Across hosts, the parts: host shards of the data, the distributed config section, the launcher.

Two real ranks (torchrun, c10d rendezvous, gloo) on two netns nodes through `dflash-ops run
start`, with the same-losses / kill -9 / resume promises: tests/integration/test_multinode_runs.py.
"""
from __future__ import annotations

import socket

import pytest
import torch

from tests.trainer.tiny_config import two_host_config
from trainer.distributed.launch import StoppedBeforeStart, describe_exit, host_store, interface_of, wait_for_new_store
from trainer.distributed.multihost import HostShard
from trainer.run import checkpoint as ckpt
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


def _checkpoint(manager, step: int) -> None:
    model = {"w": torch.arange(4, dtype=torch.float32)}
    manager.save(step, model, {"layers": 1}, {"optimizer": {}, "scheduler": {}}, {"data": {}})


def test_a_half_written_checkpoint_is_not_resumed_from_and_auto_starts_fresh_without_one(tmp_path):
    manager = ckpt.CheckpointManager(tmp_path, keep=5)
    assert manager.resolve("auto") is None  # a supervisor's restart before the first checkpoint: fresh
    with pytest.raises(ckpt.CheckpointError, match="no complete checkpoint"):
        manager.resolve("latest")
    _checkpoint(manager, 5)
    _checkpoint(manager, 10)
    model = manager.path(10) / ckpt.MODEL_FILE
    model.write_bytes(model.read_bytes()[:-8])  # truncated: its manifest names another size
    assert manager.steps() == [5, 10] and manager.restorable_steps() == [5]
    assert manager.resolve("auto") == manager.resolve("latest") == manager.path(5)
    with pytest.raises(ckpt.CheckpointError, match=r"no complete checkpoint step_10 .*\(have: \[5\]\)"):
        manager.resolve("10")


def test_a_host_rejoins_only_the_store_host_s_new_store():
    """After a crash every launcher restarts at the same endpoint: a host that is back first must
    not join the old attempt's store, still up while its host's launcher ends."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        endpoint = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(TimeoutError, match="no store answers"):
        wait_for_new_store(endpoint, None, timeout_s=0.5, poll_s=0.1)
    old, first = host_store(endpoint, 5.0)
    assert wait_for_new_store(endpoint, None, timeout_s=5.0) == first  # the first start: any store
    with pytest.raises(TimeoutError, match="only the store of the last attempt answers"):
        wait_for_new_store(endpoint, first, timeout_s=0.5, poll_s=0.1)
    with pytest.raises(StoppedBeforeStart, match="stopped by the operator while waiting"):
        wait_for_new_store(endpoint, first, timeout_s=30.0, poll_s=0.1, stop_asked=lambda: True)
    del old  # the old attempt's launcher ends, the store host's new one serves the endpoint
    _new, second = host_store(endpoint, 5.0)
    assert second != first and wait_for_new_store(endpoint, first, timeout_s=5.0) == second


def test_a_group_stopped_while_one_host_is_in_its_setup_ends_stopped_on_every_host(tmp_path):
    """`run stop` of a group whose ranks are in different phases: rank 1 still fits its target (a
    stop there is served at once, with no step to agree on), rank 0 already trains and waits for it in
    the first collective, which fails when rank 1's process ends. Rank 0 read `failed` (the README
    tour saw it under load); the stop reached it too and no peer failed, so it ends `stopped`.
    (Rank 1's config fits its target until it is stopped: the phases differ without a race.)"""
    import json
    import subprocess
    import sys
    import time

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dirs = [tmp_path / f"rank{r}" for r in range(2)]
    ranks = []
    for r, fit_steps in enumerate((10, 10**7)):
        config = tmp_path / f"rank{r}.yaml"
        config.write_text(two_host_config(50, f"model: {{target: {{tiny: {{fit_steps: {fit_steps}}}}}}}"))
        ranks.append(subprocess.Popen([sys.executable, "-m", "trainer", "launch", "--nnodes", "2", "--rdzv-endpoint",
                                       f"127.0.0.1:{port}", "--rdzv-id", "group-stop",
                                       *(["--store-host"] if r == 0 else []), "--local-addr", "127.0.0.1",
                                       "--config", str(config), "--run-dir", str(dirs[r])],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def status(r: int) -> dict:
        try:
            return json.loads((dirs[r] / "status.json").read_text())
        except (OSError, ValueError):
            return {}

    try:
        deadline = time.monotonic() + 300
        while (status(0).get("phase") or {}).get("name") != "training" \
                or (status(1).get("phase") or {}).get("name") != "fitting the target":
            assert time.monotonic() < deadline and all(p.poll() is None for p in ranks), (status(0), status(1))
            time.sleep(0.05)
        time.sleep(1.0)  # rank 0 waits for rank 1 in its first step's collective
        for run_dir in dirs:  # what `run stop` leaves on every host of the group
            (run_dir / "control" / ".no-restart").write_text(json.dumps({"why": "stop requested", "time": time.time()}))
            (run_dir / "control" / "stop").write_text(json.dumps({"id": "a1", "time": time.time()}))
        codes = [p.wait(timeout=120) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    finals = [status(r) for r in range(2)]
    assert [s.get("state") for s in finals] == ["stopped", "stopped"], [(s.get("state"), s.get("error")) for s in finals]
    assert codes == [0, 0] and finals[0]["phase"]["name"] == "training"
    assert "the other hosts stopped first" in (dirs[0] / "train.log").read_text()
