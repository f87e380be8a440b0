"""bench/headroom.py end to end on CPU (the quality bench's tiny preset): the target and a snapshot of it
less trained, lookup's τ and the ceiling of each on both prompt sets, and a rerun that measures only what
the first left."""

import json

import pytest

from bench import headroom

pytestmark = pytest.mark.slow


def test_headroom_of_the_target_and_its_snapshot_resumes_what_is_left(tmp_path, capsys):
    argv = ["--preset", "tiny", "--out", str(tmp_path), "--snapshots", "30", "--temperatures", "0", "1"]
    found = headroom.main(argv)
    assert sorted(found) == ["30/held-out", "30/other", "60/held-out", "60/other"]
    snapshot, final = found["30/held-out"], found["60/held-out"]
    assert (tmp_path / "model-step30" / "config.json").exists() and snapshot["model_dir"] != final["model_dir"]
    assert snapshot["lm_loss_heldout_rows"] > final["lm_loss_heldout_rows"]  # 30 steps of 60: a less sharp target
    for m in found.values():
        greedy, hot = m["by_temperature"]["0"], m["by_temperature"]["1"]
        # T = 0: the target's own chain is always accepted, so no round of lookup's produces more
        assert greedy["tau_ceiling"] == greedy["tau_ceiling_expected"] >= greedy["tau_lookup"] >= 1
        assert greedy["ceiling_over_lookup"] == greedy["tau_ceiling"] / greedy["tau_lookup"]
        assert 1 <= hot["tau_ceiling_expected"] < greedy["tau_ceiling"]
        assert len(hot["ceiling_acceptance_expected"]) == 16 - 1  # the preset's block size
    table = (tmp_path / "headroom.md").read_text().splitlines()
    assert len(table) == 2 + 4 * 2 and table[2].startswith("| 30 | ")

    # a later call: the bench's stages are not run again, a measurement left out is made, the rest kept
    quality_json = (tmp_path / "quality.json").read_text()
    kept = json.loads((tmp_path / "headroom.json").read_text())
    del kept["60/other"]
    (tmp_path / "headroom.json").write_text(json.dumps(kept))
    capsys.readouterr()
    again = headroom.main(argv)
    said = [line for line in capsys.readouterr().out.splitlines() if line.startswith("headroom: target")]
    assert len(said) == 1 and said[0].startswith("headroom: target step 60, other: T=0 lookup ")
    assert again == found and (tmp_path / "quality.json").read_text() == quality_json  # alike: each prompt its own noise
