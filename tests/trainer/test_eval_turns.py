"""τ at every assistant turn of agent conversations: the prompts (trainer.data.turns) and a run on
trajectories regenerated from the agent fixture reporting τ per assistant turn, as `python -m trainer
eval` then does for its checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainer.data.turns import turn_prompts

CHAT = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                     {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]}
AGENT = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"},
                      {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f"}}]},
                      {"role": "tool", "content": "r"}, {"role": "assistant", "content": "done"}]}


def test_the_prompts_of_each_mode():
    last = turn_prompts([CHAT, AGENT], "last")
    assert [(t.conversation, t.turn, len(t.messages)) for t in last] == [(0, 1, 3), (1, 1, 4)]
    every = turn_prompts([CHAT, AGENT], "every")
    assert [(t.conversation, t.turn, len(t.messages)) for t in every] == [(0, 0, 1), (0, 1, 3), (1, 0, 2), (1, 1, 4)]
    assert every[3].messages == AGENT["messages"][:4]  # the context after the tool result
    auto = turn_prompts([CHAT, AGENT], "auto")  # every turn only where the conversation holds tool results
    assert [(t.conversation, t.turn) for t in auto] == [(0, 1), (1, 0), (1, 1)]
    opening = {"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "x"}]}
    assert turn_prompts([opening], "every") == []
    with pytest.raises(ValueError, match="turns must be one of auto, last, every"):
        turn_prompts([CHAT], "all")  # type: ignore[arg-type]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_a_run_on_regenerated_trajectories_reports_tau_per_assistant_turn(agent_fixture, tmp_path, capsys):
    from trainer.__main__ import main
    from trainer.entry import train
    from trainer.run.config import parse_config
    from trainer_tools import regen
    from trainer_tools.fixtures.agent import tool_exec_argv

    data = tmp_path / "trajectories.jsonl"
    assert regen.main(["--agentic", "--engine", "hf", "--model-path", str(agent_fixture["model"]),
                       "--in", str(agent_fixture["traces"]), "--out", str(data), "--max-tokens", "48",
                       "--tool-exec", json.dumps(tool_exec_argv(agent_fixture["files"]))]) == 0
    text = json.dumps({
        "model": {"target": {"path": str(agent_fixture["model"])}, "drafter_layers": 1, "block_size": 4,
                  "num_target_layers": 2, "dtype": "fp32", "loss_chunk": 256},
        "data": {"train_path": str(data), "eval_path": str(data), "max_length": 512, "num_anchors": 8,
                 "token_budget": 1024, "bucket_edges": [512], "pad_multiple": 16},
        "optim": {"lr": 3e-3, "total_steps": 2},
        "run": {"threads": 1, "log_every": 2},
        "eval": {"samples": 6, "max_new_tokens": 8}})
    cfg = parse_config(text)
    run_dir = tmp_path / "run"
    assert train(cfg, run_dir) == 0, (run_dir / "train.log").read_text()[-2000:]
    [event] = [e for e in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
               if e["event"] == "eval"]
    # six trajectories: 13 assistant turns, one to three per trajectory (the triple's third answer)
    assert (event["samples"], event["prompts"]) == (6, 13)
    by_turn = event["tau_by_turn"]
    assert list(by_turn) == ["1", "2", "3"]
    assert [by_turn[k]["prompts"] for k in by_turn] == [6, 5, 2]
    assert all(b["tau"] >= 1.0 for b in by_turn.values())
    assert sum(b["prompts"] for b in event["tau_by_length"].values()) == 13
    log = Path(run_dir / "train.log").read_text()
    assert "tau by assistant turn: turn 1 " in log and "(13 assistant turns)" in log

    # `python -m trainer eval` on the run's checkpoint: the same τ per assistant turn (its main() here; the
    # command in a fresh process, as a user runs it, is tests/trainer/test_draft_eval.py's)
    config = tmp_path / "agent.yaml"
    config.write_text(text)
    (checkpoint,) = sorted((run_dir / "checkpoints").glob("step_*"))
    capsys.readouterr()
    assert main(["eval", "--config", str(config), "--checkpoint", str(checkpoint),
                 "--json", str(tmp_path / "eval.json")]) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "eval.json").read_text())
    assert (report["samples"], report["prompts"]) == (6, 13)
    # the same prompts per turn as the run's evaluation (τ itself may differ by a flipped near-tie: the
    # barely trained draft, another process's thread count)
    turns = report["temperatures"]["0"]["tau_by_turn"]
    assert {k: (b["prompts"], b["prompt_tokens"]) for k, b in turns.items()} == \
        {k: (b["prompts"], b["prompt_tokens"]) for k, b in by_turn.items()}
    assert all(b["tau"] >= 1.0 and b["tau_lookup"] >= 1.0 for b in turns.values())
    assert "T=0 assistant turn 3: tau " in out and "(2 prompts)" in out
