"""The run directory's contract (trainer/run/contract.py): one definition that the trainer, the
helpers (a copy shipped beside them, inside their hash) and the operator's readers all use."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

import dflash_ops.helpers as helpers_pkg
from dflash_ops.helpers import bundle, nodefacts
from dflash_ops.runs.info import RunInfo
from dflash_ops.tui.remote import run_row_from_info
from tests.procs import proc_stat
from trainer.distributed import launch
from trainer.run import contract, rundir

SAMPLES = {int: 7, float: 1.5, str: "x", list: [1, 2], dict: {"message": "m"}}
RESHAPED_BY_THE_ROW = {"state", "step", "recompiles", "gpus", "error", "run_id"}  # RunRow's own fields


@pytest.fixture
def zombie():
    """A child that exited and is not reaped yet."""
    proc = subprocess.Popen(["true"])
    for _ in range(500):
        fields = proc_stat(proc.pid)
        if fields is not None and fields[0] == "Z":
            break
        time.sleep(0.01)
    else:
        pytest.fail("the child never became a zombie")
    yield proc.pid
    proc.wait()


def test_a_zombie_is_gone_for_the_helpers_and_for_the_trainer(zombie):
    assert contract.process_start_ticks(zombie) is None
    assert nodefacts.process_start_ticks(zombie) is None and not nodefacts.process_matches(zombie, None)
    assert launch.process_start_ticks(zombie) is None  # the launcher's liveness check of its rank
    assert rundir.process_start_ticks(zombie) is None
    # a live process has a start time, the same on both sides
    me = contract.process_start_ticks(os.getpid())
    assert me is not None and nodefacts.process_start_ticks(os.getpid()) == launch.process_start_ticks(os.getpid()) == me


def test_every_copy_is_the_contract():
    assert nodefacts.FINAL_STATES is contract.FINAL_STATES
    for name in ("process_start_ticks", "write_atomic", "sha256_file", "fsync_dir"):
        assert getattr(nodefacts, name) is getattr(contract, name)
    assert launch.FINAL_STATES is contract.FINAL_STATES


def test_the_trainer_writes_only_status_fields_the_contract_names(tmp_path):
    rd = rundir.RunDir(tmp_path / "r1", total_steps=3)
    try:
        rd.update(state="running", tau=2.0, tau_lookup=1.0, tau_ratio=2.0, tokens_per_s_steady=5.0, pad_share=0.1)
    finally:
        rd.close()
    written = json.loads((tmp_path / "r1" / "status.json").read_text())
    assert set(written) <= set(contract.status_field_names())
    assert written["version"] == contract.CONTRACT_VERSION and written["state"] in contract.STATES


def test_run_info_and_run_row_read_every_status_field_of_the_contract():
    doc = {"run_id": "r1", "effective_state": "running"}
    doc.update({name: SAMPLES[kind] for name, kind in contract.STATUS_FIELDS if name != "run_id"})
    info = RunInfo.from_json(doc)
    row = run_row_from_info("t", info)
    for name, _ in contract.STATUS_FIELDS:
        assert getattr(info, name) == doc[name], name
        if name not in RESHAPED_BY_THE_ROW:
            assert getattr(row, name) == doc[name], name
    assert set(info.status) == set(contract.status_field_names())


def test_a_mistyped_or_missing_status_field_reads_none():
    info = RunInfo.from_json({"run_id": "r1", "loss": "NaN?", "step": True, "tau": 2})
    assert info.loss is None and info.step is None and info.tau == 2 and info.tau_ratio is None
    with pytest.raises(AttributeError):
        _ = info.no_such_field


def test_a_new_status_field_is_named_once(monkeypatch):
    """Adding a field to the contract is all RunInfo and RunRow need (a renderer draws it)."""
    monkeypatch.setattr(contract, "STATUS_FIELDS", contract.STATUS_FIELDS + (("grad_norm_p99", float),))
    info = RunInfo.from_json({"run_id": "r1", "grad_norm_p99": 0.25})
    assert info.grad_norm_p99 == 0.25 and run_row_from_info("t", info).grad_norm_p99 == 0.25


def test_the_contract_ships_beside_the_helpers_inside_their_hash(tmp_path, monkeypatch):
    runs = bundle("runs")
    assert [name for name, _ in runs.files][0] == "contract.py"
    assert dict(runs.files)["contract.py"] == Path(contract.__file__).read_bytes()
    copy = tmp_path / "contract.py"
    copy.write_bytes(Path(contract.__file__).read_bytes() + b"\n# a change to the contract\n")
    real = helpers_pkg.shared_path
    monkeypatch.setattr(helpers_pkg, "shared_path", lambda module: copy if module == "contract" else real(module))
    assert bundle("runs").digest != runs.digest


def test_write_atomic_leaves_no_tmp_file_when_the_write_fails(tmp_path):
    target = tmp_path / "status.json"
    contract.write_atomic(target, b"old")
    with pytest.raises(TypeError):
        contract.write_atomic(target, "not bytes")  # type: ignore[arg-type]
    assert target.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["status.json"]
    assert contract.sha256_file(target) == hashlib.sha256(b"old").hexdigest()


def test_a_reader_on_the_run_s_machine_reads_back_what_the_trainer_wrote(tmp_path):
    run = tmp_path / "run"
    assert contract.read_status(run) is None and contract.read_events(run) == []  # nothing written yet
    rd = rundir.RunDir(run, total_steps=3)
    rd.event("step", 1, loss=2.0)
    rd.event("eval", 1, tau=3.5)
    rd.update(state="running", step=1)
    rd.close()
    with open(run / "metrics.jsonl", "a") as f:
        f.write('\n{"event": "step", "ste')  # a blank line, then the trainer killed mid-line
    assert contract.read_status(run)["state"] == "running"
    assert [(e["event"], e["step"]) for e in contract.read_events(run)] == [("step", 1), ("eval", 1)]
    (run / "status.json").write_text("[1, 2]")
    assert contract.read_status(run) is None  # JSON, but not a status document


def test_a_reader_reads_the_run_s_log_as_text_even_before_it_exists(tmp_path):
    assert contract.read_log(tmp_path) == ""
    (tmp_path / "train.log").write_bytes(b"step 1\n\xff bad byte\n")
    assert contract.read_log(tmp_path) == "step 1\n\ufffd bad byte\n"
