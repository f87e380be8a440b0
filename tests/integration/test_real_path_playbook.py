"""playbooks/real-path.yaml end to end on the simulated node, shrunk by its vars (slow): a
hub-format model dir and prompts pushed, served and regenerated, a drafter trained from
model.target.path on the regenerated data, exported, and the export fetched back."""

from __future__ import annotations

import json

import pytest

from tests.conftest import free_port, play, write_sim_inventory

pytestmark = [pytest.mark.slow, pytest.mark.lxc_tier]


def test_real_path_playbook_end_to_end(tmp_path):
    inventory = write_sim_inventory(tmp_path / "simnode")
    base = tmp_path / "simnode" / "ct200" / "opt" / "dflash"
    local = tmp_path / "local"
    result = play(inventory, "real-path.yaml", f"local_dir={local}", "prompts=6", "fit_steps=0", "train_steps=4",
                  "max_tokens=8", "concurrency=3", f"port={free_port()}")
    assert result.exit_code == 0, result.output
    assert "regen: 6 regenerated, 0 already done, 0 failed" in result.stdout
    assert "regen: 12 regenerated, 0 already done, 0 failed" in result.stdout  # two sampled answers a prompt
    assert "real-path: 13/13 steps OK" in result.stdout
    data = base / "data" / "real-path"
    regen = [json.loads(line) for line in (data / "regen.jsonl").read_text().splitlines()]
    assert len(regen) == 6 and all(r["messages"][-1]["role"] == "assistant" for r in regen)
    sampled = [json.loads(line) for line in (data / "regen-sampled.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in sampled) == sorted(f"{r['id']}#{k}" for r in regen for k in (0, 1))
    (run_dir,) = [p for p in (base / "runs").iterdir() if p.is_dir()]
    config = (run_dir / "config.yaml").read_text()
    assert f"path: {base}/data/real-path/models/tiny-qwen3" in config, "trained from the pushed model dir"
    assert f"train_path:\n  - {data}/regen.jsonl\n  - {data}/regen-sampled.jsonl\n" in config  # the recommended data
    export = local / "exports" / run_dir.name
    fetched = {p.relative_to(export).as_posix(): p.read_bytes() for p in export.rglob("*") if p.is_file()}
    made = {p.relative_to(run_dir / "export").as_posix(): p.read_bytes()
            for p in (run_dir / "export").rglob("*") if p.is_file()}
    assert fetched == made and "config.json" in fetched
    assert json.loads(fetched["config.json"])["auto_map"], "loads with trust_remote_code"
    record = json.loads((base / "services" / "engine" / "service.json").read_text())
    assert record["state"] == "stopped"
