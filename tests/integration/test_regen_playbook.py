"""playbooks/regen.yaml on the simulated node and through a real sshd, with the real stand-in
server and trainer regen (slow): the engine serves, answers, and is stopped, also when the
regeneration fails."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import free_port, play, write_sim_inventory
from tests.containers import ContainerProcs
from tests.trainer.test_regen import write_fixture_model

pytestmark = [pytest.mark.slow, pytest.mark.lxc_tier]


def engine_state(base: Path) -> dict:
    return json.loads((base / "services" / "engine" / "service.json").read_text())


@pytest.fixture(params=["sim", pytest.param("sshd", marks=pytest.mark.sshd)])
def node(request, tmp_path):
    """(tier, inventory, base_dir, the container's processes) of host200."""
    if request.param == "sim":
        return ("sim", write_sim_inventory(tmp_path / "simnode"), tmp_path / "simnode" / "ct200" / "opt" / "dflash",
                ContainerProcs(tmp_path / "simnode" / "sim", 200))
    sshd = request.getfixturevalue("sshd_node")
    shutil.rmtree(sshd.base_dir, ignore_errors=True)
    return "sshd", sshd.inventory, Path(sshd.base_dir), ContainerProcs(sshd.sim_root, 200)


def test_regen_playbook_serves_regenerates_and_stops_the_engine(node, tmp_path):
    """The sim tier regenerates for real and the engine is stopped at the end; the sshd tier's
    regeneration fails and the engine is stopped by the playbook's cleanup. One case a tier (each
    play starts the engine: ~4 CPU-seconds of imports and model load); a serve step's cleanup after a
    failing step on the simulated node, with a light engine, is tests/integration/test_services.py's."""
    tier, inventory, base, procs = node
    data = base.parent / "data" / tmp_path.name
    write_fixture_model(data / "models" / "tiny")
    (data / "prompts.jsonl").write_text("".join(
        json.dumps({"id": f"q{i}", "messages": [{"role": "user", "content": f"step3 v{i}"}]}) + "\n" for i in range(6)))
    common = [f"data_dir={data}", f"model_dir={data}/models/tiny", f"port={free_port()}", "max_tokens=4",
              "concurrency=3"]
    if tier == "sim":
        result = play(inventory, "regen.yaml", *common)
        assert result.exit_code == 0, result.output
        assert re.search(r"regen: 6 regenerated, 0 already done, 0 failed, \d+ truncated", result.stdout)
        assert sorted(json.loads(line)["id"] for line in (data / "regen.jsonl").read_text().splitlines()) == \
            [f"q{i}" for i in range(6)]
        # and the sampled answers beside them, two a prompt at T = 1, each seeded
        sampled = [json.loads(line) for line in (data / "regen-sampled.jsonl").read_text().splitlines()]
        assert sorted(r["id"] for r in sampled) == [f"q{i}#{k}" for i in range(6) for k in (0, 1)]
        assert len({r["seed"] for r in sampled}) == 12
        assert f"greedy answers in host200:{data}/regen.jsonl; sampled: regen: 12 regenerated" in result.stdout
        assert f"-> host200:{data}/regen-sampled.jsonl" in result.stdout
        first = engine_state(base)
        assert first["state"] == "stopped" and not procs.alive(first["pid"])
        return

    failed = play(inventory, "regen.yaml", *common, f"prompts={data}/missing.jsonl")
    assert failed.exit_code != 0
    assert "regen.yaml" in failed.output and "step 3 (regenerate the answers) failed" in failed.output
    assert "cannot read" in failed.output
    assert "[cleanup] stop service engine" in failed.output
    second = engine_state(base)
    assert second["state"] == "stopped" and not procs.alive(second["pid"])
