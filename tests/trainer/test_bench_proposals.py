"""bench/proposals.py end to end on CPU, on the quality bench's tiny preset: the sampled answers, a candidate on
the greedy answers and one on both, each evaluated with argmax and with sampled proposals, the headroom, and a
rerun that trains nothing again."""

from collections import Counter

import pytest

from bench import proposals, quality
from trainer.generate import evaluate

pytestmark = pytest.mark.slow


def test_candidates_by_proposals_beside_lookup_and_the_ceiling(tmp_path, capsys, monkeypatch):
    quality.main(["--preset", "tiny", "--out", str(tmp_path / "q"), "--no-ablations"])
    decoded: Counter = Counter()  # (temperature, proposals) of each decode of the held-out prompts
    report = evaluate.acceptance_report

    def counted(*args, sampling, **kwargs):
        decoded[sampling.temperature, sampling.draft] += 1
        return report(*args, sampling=sampling, **kwargs)

    monkeypatch.setattr(evaluate, "acceptance_report", counted)
    argv = ["--quality", str(tmp_path / "q"), "--out", str(tmp_path / "p"), "--candidates", "ce+dpace/greedy,kl/both",
            "--seeds", "0", "--steps", "3", "--samples-per-prompt", "2", "--temperatures", "0", "1"]
    doc = proposals.main(argv)
    rows = (tmp_path / "q" / "data" / "sampled.jsonl").read_text().splitlines()
    greedy_rows = (tmp_path / "q" / "data" / "regen.jsonl").read_text().splitlines()
    assert len(rows) == 2 * len(greedy_rows)  # two sampled answers a prompt
    assert sorted(doc["runs"]) == ["ce+dpace/greedy", "kl/both"]
    # each run: its trainer's own evaluation at T = 0 (in this process on the tiny preset), then the bench's: T = 0
    # once (argmax whatever the proposals), T = 1 once per kind of proposals
    assert decoded == {(0.0, "greedy"): 2 + 2, (1.0, "greedy"): 2, (1.0, "probabilistic"): 2}
    for by_seed in doc["runs"].values():
        r = by_seed["0"]
        assert r["greedy"]["0"] == r["probabilistic"]["0"]  # T = 0 is greedy whatever the engine's proposals
        assert r["greedy"]["1"]["tau_lookup"] == r["probabilistic"]["1"]["tau_lookup"] == doc["headroom"]["1"]["tau_lookup"]
    assert doc["headroom"]["0"]["tau_ceiling"] >= max(r["0"]["greedy"]["0"]["tau"] for r in doc["runs"].values())
    table = (tmp_path / "p" / "proposals.md").read_text().splitlines()
    assert len(table) == 2 + 2 * 2 + 2 and table[2].startswith("| ce+dpace/greedy | greedy | ")
    assert table[-1].startswith("| the ceiling (bounds argmax) | argmax | ")

    capsys.readouterr()
    again = proposals.main(argv)  # every run has its last checkpoint: nothing is trained or sampled again
    assert "trained " not in capsys.readouterr().out and again["runs"] == doc["runs"]
