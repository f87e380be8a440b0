"""bench/quality_objectives.py: the second prompt set, the table and its verdict, and (slow) the
tiny preset end to end on CPU."""
import json

import pytest

from bench import quality_objectives as qo


def test_code_prompts_are_signatures_with_docstrings_and_deterministic():
    prompts = qo.code_prompts(50, 7)
    assert prompts == qo.code_prompts(50, 7) and prompts != qo.code_prompts(50, 8)
    for p in prompts:
        user, assistant = p["messages"]
        assert user["role"] == "user" and assistant == {"role": "assistant", "content": ""}
        text = user["content"]
        assert text.startswith("def ") and ") -> " in text and text.count('"""') == 2 and "Args:" in text
    assert len({p["messages"][0]["content"] for p in prompts}) == 50


def run(tau, code, steps=10):
    return {"tau": tau, "tau_code": code, "tau_ratio": tau / 2, "steps": steps, "acceptance": [tau - 1, 0.0],
            "tokens_per_s_steady": 100.0}


def test_the_table_gives_each_objective_its_seed_spread_and_the_verdict_needs_more_than_it():
    rows = {"ce+decay": [run(3.0, 2.0), run(3.2, 2.1), run(3.1, 2.2)],
            "ce+dpace": [run(3.2, 2.1), run(3.3, 2.0), run(3.25, 2.2)],  # +0.15: inside the 0.2 range
            "kl": [run(3.6, 2.1), run(3.7, 2.0), run(3.65, 2.15)]}  # +0.55 held-out: beyond it
    table = qo.summarise(rows, {"ce+decay": 0.010, "ce+dpace": 0.0102, "kl": 0.0125})
    assert table["ce+decay"]["tau"]["mean"] == pytest.approx(3.1)
    assert table["ce+decay"]["tau"]["std"] == pytest.approx(0.1)
    assert (table["ce+decay"]["tau"]["min"], table["ce+decay"]["tau"]["max"]) == (3.0, 3.2)
    assert table["kl"]["step_cost"] == pytest.approx(0.25) and table["ce+decay"]["step_cost"] == 0
    assert table["kl"]["acceptance"] == pytest.approx([2.65, 0.0])
    held, code = qo.verdict(table)
    assert held.startswith("held-out: kl (+0.550") and "ce+dpace" not in held
    assert code == "code prompts: no objective beats ce+decay beyond the seed spread: keep the default"
    assert "| kl | 3/3 | [10, 10, 10] | 3.650 ± 0.050 (3.600-3.700) |" in qo.markdown(
        {"table": table, "verdict": [held, code], "command": "c", "train_convs": 1, "heldout_prompts": 1,
         "code_prompts": 1, "preset": {"quality": "tiny", "seeds": [0, 1, 2], "code_new_tokens": 8}})


def preset(**kw):
    return qo.Preset(**{"parallel": 4, "startup_s": 40.0, "startup_share": 5.0, "cold_start_s": 30.0, "end_s": 10.0,
                        "eval_s": 3.0, "share_gain": 1.5, "min_train_s": 4.0, **kw})


def test_the_plan_gives_every_run_what_the_budget_leaves_after_its_fixed_costs():
    plan = qo.plan_runs(preset(), 400.0)
    assert plan.seeds == (0, 1, 2) and plan.waves == [4, 4, 4]
    # per wave: 40 s start + 3 x 5 s beside it + 10 s end; 30 s cold; 12 x 3 s of code τ: 261 s fixed,
    # 3 waves x 4 runs / 1.5: 8 s of wall per second of a run's training
    assert plan.train_s == pytest.approx((400 - 261) / 8)
    assert plan.estimate_s == pytest.approx(400.0)
    assert qo.runs_wall(preset(), 12, plan.train_s)[0] == pytest.approx(400.0)


def test_equal_wall_clock_gives_slower_objectives_fewer_steps():
    plan = qo.plan_runs(preset(train_s=6.0), 1000.0, {"ce+decay": 0.02, "ce+dpace": 0.02, "kl": 0.03, "ce+kl": 0.04})
    assert plan.train_s == 6.0 and plan.steps == {"ce+decay": 300, "ce+dpace": 300, "kl": 200, "ce+kl": 150}
    # no budget: ce+decay's `steps`, the others the same device time
    plan = qo.plan_runs(preset(steps=100), None, {"ce+decay": 0.02, "ce+dpace": 0.02, "kl": 0.04, "ce+kl": 0.05})
    assert plan.steps == {"ce+decay": 100, "ce+dpace": 100, "kl": 50, "ce+kl": 40} and plan.seeds == (0, 1, 2)
    # max_steps caps the fastest objective, the others keep its device time
    plan = qo.plan_runs(preset(train_s=6.0, max_steps=100), 1000.0, {"ce+decay": 0.02, "ce+dpace": 0.02, "kl": 0.04,
                                                                      "ce+kl": 0.05})
    assert plan.train_s == pytest.approx(2.0) and plan.steps == {"ce+decay": 100, "ce+dpace": 100, "kl": 50, "ce+kl": 40}
    assert "lowered to 2.0s" in plan.notes[0]


def test_a_tight_budget_shrinks_the_training_then_drops_seeds_then_refuses():
    shrunk = qo.plan_runs(preset(train_s=30.0), 400.0)
    assert shrunk.train_s < 30.0 and shrunk.seeds == (0, 1, 2) and "does not fit" in shrunk.notes[0]
    dropped = qo.plan_runs(preset(), 262.0)  # 3 seeds: 1 s of training a run; 2 seeds fit more than 4 s
    assert dropped.seeds == (0, 1) and dropped.train_s >= 4.0 and "seed 2 dropped" in dropped.notes[0]
    with pytest.raises(qo.PlanError, match=r"8 runs \(4 objectives x 2 seeds, 2 waves of 4\) at 4s of training each "
                                            r"need 205s, 200s are left"):
        qo.plan_runs(preset(), 200.0)


def test_plan_only_says_what_fits_and_runs_nothing(tmp_path, capsys):
    r = qo.main(["--preset", "h200", "--out", str(tmp_path / "out"), "--plan-only", "--budget-s", "570"])
    assert r["plan"]["seeds"] == (0, 1, 2) and r["plan"]["train_s"] > 4 and not (tmp_path / "out").exists()
    assert "12 runs in 2 waves [6, 6]" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="the plan does not fit"):
        qo.main(["--preset", "h200", "--out", str(tmp_path / "out"), "--plan-only", "--budget-s", "400"])


@pytest.mark.slow
def test_tiny_objectives_bench_runs_every_objective_and_seed(tmp_path):
    r = qo.main(["--preset", "tiny", "--out", str(tmp_path), "--set", "seeds=[0, 1]"])
    rows = set(qo.Preset().objectives)  # the four of the earlier ablation (kl+dpace is named when wanted)
    assert set(r["table"]) == rows and set(r["timing"]) == rows
    for name, runs in r["runs"].items():
        assert [x["seed"] for x in runs] == [0, 1]
        for x in runs:
            assert x["exit"] == 0 and x["tau"] >= 1.0 and x["tau_code"] >= 1.0, (name, x)
            assert len(x["acceptance"]) == 15
        assert r["table"][name]["tau"]["n"] == 2 and r["table"][name]["step_s"] > 0
    logs = {name: (tmp_path / "runs-objectives" / f"{name}-seed-0" / "train.log").read_text() for name in rows}
    assert "objective: kl, decay" in logs["kl"] and "objective: ce, dpace" in logs["ce+dpace"]
    assert len(r["verdict"]) == 2 and "| ce+kl |" in (tmp_path / "objectives.md").read_text()
    assert json.loads((tmp_path / "objectives.json").read_text())["code_prompts"] == 4


def test_the_dflash2_presets_compare_the_two_generations_against_dflash1():
    for name in ("dflash2-h200", "dflash2-cpu"):
        p = qo.PRESETS[name]
        assert p.objectives == ("dflash1", "dflash2") and p.baseline == "dflash1" and p.seeds == (0, 1, 2)
    assert qo.VARIANTS["dflash2"] == {"drafter": {"kind": "dflash2"}} and qo.VARIANTS["dflash1"] == {}
    rows = {"dflash1": [run(2.0, 1.5), run(2.1, 1.6), run(2.2, 1.5)],
            "dflash2": [run(2.6, 1.6), run(2.7, 1.5), run(2.65, 1.55)]}
    table = qo.summarise(rows, {"dflash1": 0.010, "dflash2": 0.012}, "dflash1")
    assert table["dflash2"]["step_cost"] == pytest.approx(0.2) and table["dflash1"]["step_cost"] == 0
    held, code = qo.verdict(table, "dflash1")
    assert held.startswith("held-out: dflash2 (+0.550") and "beat dflash1" in held
    assert code == "code prompts: no objective beats dflash1 beyond the seed spread: keep the default"
    md = qo.markdown({"table": table, "verdict": [held, code], "command": "c", "train_convs": 1, "heldout_prompts": 1,
                      "code_prompts": 1, "preset": {"quality": "tiny", "seeds": [0, 1, 2], "code_new_tokens": 8,
                                                    "title": "DFlash2 vs DFlash1", "baseline": "dflash1"}})
    assert md.startswith("# DFlash2 vs DFlash1 (c)") and "cost vs dflash1" in md
    assert "| dflash2 | 3/3 | [10, 10, 10] | 2.650 ± 0.050 (2.600-2.700) |" in md and md.count("| 100 | - |") == 2


def test_training_pace_is_the_runs_wall_time_and_the_mean_of_its_logged_rates(tmp_path):
    events = [{"event": "start", "time": 100.0}, {"event": "step", "time": 103.0, "tokens_per_s": 10.0},
              {"event": "step", "time": 110.0, "tokens_per_s": 400.0}, {"event": "step", "time": 112.5, "tokens_per_s": 200.0},
              {"event": "eval", "time": 130.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert qo.training_pace(tmp_path) == {"train_s": 12.5, "tokens_per_s_mean": 300.0}
    assert qo.training_pace(tmp_path / "none") == {"train_s": None, "tokens_per_s_mean": None}


def test_a_baseline_that_is_not_a_row_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        qo.main(["--preset", "tiny", "--out", str(tmp_path), "--set", "baseline=dflash1"])
    assert "baseline 'dflash1' is not one of the rows" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_bench_trains_dflash1_and_dflash2_side_by_side(tmp_path):
    r = qo.main(["--preset", "tiny", "--out", str(tmp_path), "--set", "objectives=[dflash1, dflash2]",
                 "--set", "baseline=dflash1", "--set", "seeds=[0]"])
    assert set(r["table"]) == {"dflash1", "dflash2"} and r["table"]["dflash1"]["step_cost"] == 0
    for name, runs in r["runs"].items():
        assert [x["exit"] for x in runs] == [0] and runs[0]["tau"] >= 1.0 and runs[0]["tau_code"] >= 1.0, name
    log = (tmp_path / "runs-objectives" / "dflash2-seed-0" / "train.log").read_text()
    assert "selector CE" in log
    assert "selector" not in (tmp_path / "runs-objectives" / "dflash1-seed-0" / "train.log").read_text()


def test_the_command_line_edits_this_bench_s_preset_and_refuses_what_it_does_not_know(capsys):
    ap = qo.parser()
    p = qo.preset_of(ap, ap.parse_args(["--out", "x", "--set", "seeds=[0, 1]", "--set", "parallel=3",
                                        "--budget-s", "300"]))
    assert (p.seeds, p.parallel, p.budget_s) == ((0, 1), 3, 300.0)
    assert qo.PRESETS["h200"].seeds == (0, 1, 2)  # the preset itself is left as it was
    for argv, message in ((["--set", "nope=1"], "--set nope=1: no preset field 'nope'"),
                          (["--set", "parallel=0"], "parallel: 0: must be at least 1"),
                          (["--set", "objectives=[kl, fast]"], "objectives: unknown ['fast']"),
                          # two runs of one name would train in one directory
                          (["--set", "objectives=[ce+decay, kl, kl]"], "objectives ['ce+decay', 'kl', 'kl']: kl named twice"),
                          (["--set", "seeds=[2, 2]"], "seeds [2, 2]: 2 named twice"),
                          (["--set", "seeds=[1, a]"], "seeds [1, 'a']: integers only")):
        with pytest.raises(SystemExit):
            qo.preset_of(ap, ap.parse_args(["--out", "x", *argv]))
        assert message in capsys.readouterr().err
