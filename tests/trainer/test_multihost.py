"""Across hosts: two ranks under `python -m trainer launch` (torchrun, c10d rendezvous, gloo).

The ranks here share 127.0.0.1; tests/integration/test_multinode_runs.py runs them on two nodes
of the netns tier through `dflash-ops run start`.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from trainer.config import ConfigError, parse_config
from trainer.entry import train
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


# ---------------------------------------------------------------------------- two real ranks

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_pair(tmp: Path, config: Path, run_dirs: list[Path], resume: str | None = None):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = []
    for i, run_dir in enumerate(run_dirs):
        argv = [sys.executable, "-m", "trainer", "launch", "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "--rdzv-id", "pair", "--config", str(config), "--run-dir", str(run_dir), "--join-timeout", "60"]
        argv += ["--store-host"] if i == 0 else []
        argv += ["--resume", resume] if resume else []
        run_dir.mkdir(exist_ok=True)
        log = open(run_dir / "train.log", "ab")
        procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True))
    return procs


def status(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def step_losses(run_dir: Path, last_life_only: bool = False) -> dict[int, float]:
    events = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if last_life_only:
        starts = [i for i, e in enumerate(events) if e["event"] == "start"]
        events = events[starts[-1]:]
    return {e["step"]: e["loss"] for e in events if e["event"] == "step"}


def wait_all(procs, seconds=120.0):
    """Every launcher's exit status (a bound for a hung test, not a timing assertion)."""
    deadline = time.monotonic() + seconds
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                os.killpg(q.pid, signal.SIGKILL)
            pytest.fail(f"launchers still running after {seconds:.0f}s")
    return codes


@pytest.mark.slow
def test_two_ranks_match_one_host_then_a_killed_rank_stops_both_and_resume_continues(tmp_path):
    """Two hosts of one micro-batch each train exactly what one host does with both micro-batches;
    kill -9 of one rank fails the other with the reason; resume restores both from the writer's
    checkpoint and they go on to match the one-host run to the end."""
    steps = 300
    config = tmp_path / "cfg.yaml"
    config.write_text(CONFIG % {"steps": steps})
    torch.manual_seed(0)
    assert train(parse_config(config.read_text()), tmp_path / "one") == 0
    one = step_losses(tmp_path / "one")
    assert sorted(one) == list(range(1, steps + 1))

    dirs = [tmp_path / "a", tmp_path / "b"]
    procs = launch_pair(tmp_path, config, dirs)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # freeze the group once it is past a checkpoint
        states = [status(d) for d in dirs]
        if all(s.get("step", 0) >= 12 and s.get("distributed", {}).get("rank") is not None for s in states):
            break
        assert all(p.poll() is None for p in procs), [d.joinpath("train.log").read_text()[-3000:] for d in dirs]
        time.sleep(0.02)
    ranks = {s["distributed"]["rank"]: (d, s["pid"]) for d, s in zip(dirs, states)}
    writer_dir, writer_pid = ranks[0]
    victim_dir, victim_pid = ranks[1]
    os.kill(writer_pid, signal.SIGSTOP)  # the group cannot advance past the victim's death
    os.kill(victim_pid, signal.SIGKILL)
    os.kill(writer_pid, signal.SIGCONT)
    assert wait_all(procs) == [1, 1]
    victim, writer = status(victim_dir), status(writer_dir)
    assert victim["state"] == writer["state"] == "failed"
    assert victim["error"]["message"] == f"the trainer process (pid {victim_pid}) killed by signal 9 (SIGKILL)"
    assert writer["error"]["message"].startswith("PeerLost: ")
    first = {**step_losses(writer_dir), **step_losses(victim_dir)}
    assert len(first) >= 12
    for step, loss in first.items():
        assert loss == pytest.approx(one[step], rel=1e-6, abs=1e-7), step
    saved = sorted(int(p.name[5:]) for p in (writer_dir / "checkpoints").glob("step_*"))
    assert saved and not list((victim_dir / "checkpoints").glob("step_*"))

    procs = launch_pair(tmp_path, config, dirs, resume="latest")
    assert wait_all(procs) == [0, 0]
    for d in dirs:
        s = status(d)
        assert s["state"] == "done" and s["step"] == steps
        resumed = step_losses(d, last_life_only=True)
        assert sorted(resumed) == list(range(saved[-1] + 1, steps + 1))
        for step, loss in resumed.items():
            assert loss == pytest.approx(one[step], rel=1e-6, abs=1e-7), (d.name, step)
