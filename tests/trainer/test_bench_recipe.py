"""bench/recipe_ablation.py: the plan's arithmetic, the data mixes, the table and its verdict, the refusals,
and (slow) the CPU preset's whole multi-call plan: two calls, the second continuing every run from the
checkpoint the first left, nothing prepared, regenerated or timed twice."""
import dataclasses
import json
import time

import pytest

from bench import recipe_ablation as ra
from trainer.run.contract import read_events


def test_a_candidate_is_an_objective_a_data_mix_a_drafter_kind_and_taps():
    assert ra.candidate_parts("kl/both") == ("kl", "both", "dflash", "default")
    assert ra.candidate_parts("kl+dpace/both/dflash2") == ("kl+dpace", "both", "dflash2", "default")
    assert ra.candidate_parts("kl/greedy/deep") == ("kl", "greedy", "dflash", "deep")
    assert ra.candidate_parts("kl/greedy/dflash2/deep") == ("kl", "greedy", "dflash2", "deep")
    # sampled and both may name how many of each prompt's sampled answers they hold
    assert ra.candidate_parts("ce+dpace/both1") == ("ce+dpace", "both1", "dflash", "default")
    assert ra.candidate_parts("ce+dpace/sampled12/dflash2") == ("ce+dpace", "sampled12", "dflash2", "default")
    assert [ra.data_parts(d) for d in ("greedy", "both", "both1", "sampled12")] == [
        ("greedy", None), ("both", None), ("both", 1), ("sampled", 12)]
    assert ra.run_name("ce+dpace/both1", 0) == "ce+dpace both1 seed 0" and ra.arm("ce+dpace/both1") == "ce+dpace"
    assert ra.run_name("ce+dpace/greedy", 2) == "ce+dpace greedy seed 2"
    assert ra.run_name("kl+dpace/both/dflash2", 1) == "kl+dpace both dflash2 seed 1"
    assert ra.run_name("kl/both/dflash2/deep", 0) == "kl both dflash2 deep seed 0"
    # the step times' key: the data does not change a step's cost, the objective, generation and taps do
    assert ra.arm("kl/both") == ra.arm("kl/greedy") == "kl" and ra.arm("kl/sampled/dflash2") == "kl/dflash2"
    assert ra.arm("kl/both/deep") == "kl/deep" and ra.arm("kl/both/dflash2/deep") == "kl/dflash2/deep"
    for bad in ("kl", "kl/mixed", "ce/greedy", "kl/both/x", "kl/both/dflash", "kl/both/dflash2/x", "kl/both/",
                "kl/both/default", "kl/both/deep/dflash2", "kl/both/deep/deep", "kl/both/dflash2/deep/x",
                "kl/greedy1", "kl/both0", "kl/sampled01", "kl/both-1", "kl/1"):
        with pytest.raises(ValueError, match="expected OBJECTIVE/DATA"):
            ra.candidate_parts(bad)


def test_deep_taps_read_the_target_s_last_layer_and_reach_the_trainer_config(tmp_path):
    import yaml

    from trainer.run.config import parse_config

    assert ra.deep_layer_ids(8, 3) == [1, 4, 7] and ra.deep_layer_ids(36, 5)[::4] == [1, 35]
    assert ra.deep_layer_ids(8, 1) == [7] and ra.deep_layer_ids(4, 3) == [1, 2, 3]
    for layers, count in ((8, 3), (36, 5), (28, 4), (5, 4)):
        ids = ra.deep_layer_ids(layers, count)
        assert len(set(ids)) == count and ids == sorted(ids) and ids[-1] == layers - 1
    p = ra.PRESETS["h200-default"]
    qp = ra.quality_preset(p)
    shallow, deep = (ra.trainer_config(p, qp, tmp_path, c, 0, 100) for c in ("ce+dpace/both", "ce+dpace/both/deep"))
    assert "target_layer_ids" not in shallow["model"]
    assert deep["model"]["target_layer_ids"] == ra.deep_layer_ids(qp.layers, qp.num_target_layers)
    assert {k: v for k, v in deep["model"].items() if k != "target_layer_ids"} == shallow["model"]
    deep["devices"] = {"target": ["cpu"], "drafter": ["cpu"]}
    assert parse_config(yaml.safe_dump(deep)).model.target_layer_ids == [1, 4, 7]


def test_legs_stop_a_run_at_its_share_of_the_steps_in_each_call():
    assert [ra.leg_end(s, 6, 2) for s in (0, 2, 3, 5)] == [3, 3, 6, 6]
    assert [ra.leg_end(s, 7, 3) for s in (0, 3, 5)] == [3, 5, 7]
    assert ra.leg_end(0, 6, 0) == 6 and ra.leg_end(4, 6, 1) == 6  # no legs: until done (or the deadline)


def test_the_plan_shares_the_calls_time_among_the_runs_at_the_rate():
    p = ra.Preset(calls=3, call_s=540.0, reserve_s=40.0, parallel=3, eval_s=20.0)
    # 100 s left in the first call, then 2 x 500 s, less the last 3 runs' evaluations (60 s); at 1.5 device-s
    # per wall-s over 12 runs
    assert ra.plan_train_s(p, 12, 1, 100.0, 1.5) == pytest.approx(1040 * 1.5 / 12)
    assert ra.plan_train_s(p, 12, 1, -20.0, 1.0) == pytest.approx(940 / 12)  # the first call already spent
    assert ra.plan_train_s(p, 12, 2, 100.0, 1.0) == pytest.approx(540 / 12)  # the data took the first call whole
    assert ra.plan_train_s(p, 2, 3, 100.0, 1.0) == pytest.approx(60 / 2)  # two runs: two evaluations at the end
    # the stated plan: the data and the timing (~630 s on an H100, more than a call) and the last 6 evaluations
    # come out of the calls' time
    h200 = ra.PRESETS["h200"]
    assert ra.data_s(h200) == 630.0
    assert ra.plan_only(h200)["train_s"] == pytest.approx((3 * 480 - 630 - 6 * h200.eval_s) / 12)
    # equal device time: slower objectives train fewer steps; max_steps lowers the time for all
    assert ra.steps_of(10.0, {"ce+decay": 0.01, "kl": 0.0125}, 5000) == (10.0, {"ce+decay": 1000, "kl": 800})
    assert ra.steps_of(10.0, {"ce+decay": 0.01, "kl": 0.0125}, 500) == (5.0, {"ce+decay": 500, "kl": 400})
    # what is left: 1,000 device-s at 1.0 over 500 s a call is 2 calls; legs and evaluations need calls of their own
    assert ra.calls_left(p, 1000.0, 0, 0, 1.0) == 2
    assert ra.calls_left(p, 10.0, 0, 3, 1.0) == 3 and ra.calls_left(p, 0.0, 2, 0, 1.0) == 1
    assert ra.calls_left(p, 0.0, 0, 0, 1.0) == 0


def records(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def conv(i, answer, **kw):
    return {"id": i, **kw, "messages": [{"role": "user", "content": f"prompt {i}"},
                                        {"role": "assistant", "content": answer}]}


def test_the_mixes_hold_the_same_prompts_greedy_sampled_and_both(tmp_path):
    records(tmp_path / "regen.jsonl", [conv(f"p{i}", "g" * 10) for i in range(6)])
    p = ra.Preset(mix_prompts=4, samples_per_prompt=2)
    ids = ra.mix_prompt_ids(tmp_path, 4, 0)
    assert len(ids) == 4 and ids == ra.mix_prompt_ids(tmp_path, 4, 0) and set(ids) < {f"p{i}" for i in range(6)}
    only_greedy = ra.write_mixes(p, tmp_path, 0)
    assert set(only_greedy) == {"greedy", "sampling"} and only_greedy["greedy"]["rows"] == 4
    assert not (tmp_path / "mix-both.jsonl").exists()
    records(tmp_path / "regen-sampled.jsonl", [conv(f"{i}#{k}", "s" * 20, prompt_id=i, sample=k)
                                               for i in ids for k in range(2)])
    mixes = ra.write_mixes(p, tmp_path, 0)
    assert (mixes["greedy"]["rows"], mixes["sampled"]["rows"], mixes["both"]["rows"]) == (4, 8, 12)
    assert mixes["both"]["greedy_rows"] == 4 and mixes["both"]["sampled_rows"] == 8
    assert mixes["sampled"]["answer_chars_mean"] == 20.0 and mixes["both"]["answer_chars_mean"] == 16.7
    assert mixes["sampling"] == {"samples_per_prompt": 2, "temperature": 1.0, "top_p": 1.0}
    both = [json.loads(line)["id"] for line in open(tmp_path / "mix-both.jsonl")]
    assert sorted(i for i in both if "#" not in i) == sorted(ids)
    # a candidate's count keeps each prompt's first sampled answers: both1 is greedy + #0, sampled1 #0 alone
    p.candidates = ("ce+dpace/both1", "ce+dpace/sampled1", "ce+dpace/sampled")
    mixes = ra.write_mixes(p, tmp_path, 0)
    assert set(mixes) == {"greedy", "sampled", "both", "both1", "sampled1", "sampling"}
    assert {k: (mixes[k]["rows"], mixes[k]["greedy_rows"], mixes[k]["sampled_rows"]) for k in ("both1", "sampled1")} \
        == {"both1": (8, 4, 4), "sampled1": (4, 0, 4)}
    both1 = [json.loads(line)["id"] for line in open(tmp_path / "mix-both1.jsonl")]
    assert sorted(both1) == sorted([*ids, *(f"{i}#0" for i in ids)])
    assert mixes["sampled1"]["answer_chars_mean"] == 20.0 and mixes["both1"]["answer_chars_mean"] == 15.0


def result(tau0, tau1, other0, other1, step=10):
    def t(tau, lookup):
        return {"tau": tau, "tau_expected": tau, "tau_lookup": lookup, "tau_ratio": tau / lookup}
    return {"step": step, "tokens": 2_000_000, "by_set": {"heldout": {"0": t(tau0, 2.0), "1": t(tau1, 1.5)},
                                                          "other": {"0": t(other0, 1.6), "1": t(other1, 1.2)}}}


def test_the_table_gives_each_set_and_temperature_its_seed_spread_and_the_verdict_needs_more_than_it():
    p = ra.Preset(candidates=("ce+decay/greedy", "kl/both", "ce+dpace/greedy"), seeds=(0, 1, 2))
    runs = {}
    for seed, (base, kl) in enumerate([(3.0, 3.1), (3.2, 3.2), (3.1, 3.3)]):
        runs[f"b{seed}"] = {"candidate": "ce+decay/greedy", "seed": seed, "failures": 0,
                            "result": result(base, 2.0, 2.0, 1.5)}
        runs[f"k{seed}"] = {"candidate": "kl/both", "seed": seed, "failures": 0,
                            "result": result(kl, 2.6 + seed * 0.05, 2.0, 1.5)}
    runs["d0"] = {"candidate": "ce+dpace/greedy", "seed": 0, "failures": 0, "result": result(4.0, 3.0, 3.0, 2.0)}
    runs["d1"] = {"candidate": "ce+dpace/greedy", "seed": 1, "failures": 2}
    table = ra.summarise(p, runs)
    base = table["ce+decay/greedy"]
    assert base["measured"] == 3 and base["seeds"] == [0, 1, 2] and base["tokens"] == 2_000_000
    assert base["heldout T=0"]["tau"]["mean"] == pytest.approx(3.1) and base["heldout T=0"]["tau"]["std"] == pytest.approx(0.1)
    assert base["heldout T=0"]["ratio"]["mean"] == pytest.approx(1.55) and base["other T=1"]["tau_lookup"] == 1.2
    assert table["ce+dpace/greedy"]["measured"] == 1 and table["ce+dpace/greedy"]["failed"] == [1]
    lines = ra.verdict(table, "ce+decay/greedy")
    assert [line.split(":")[0] for line in lines] == ["heldout T=0", "heldout T=1", "other T=0", "other T=1"]
    # kl/both at T = 1 on held-out: +0.65 against a spread of 0.1 -> named; at T = 0: +0.1 inside the 0.2 range
    assert lines[1] == "heldout T=1: kl/both (+0.650, spread 0.100) beat ce+decay/greedy beyond the seed spread"
    assert lines[0] == "heldout T=0: nothing beats ce+decay/greedy beyond the seed spread"
    assert "ce+dpace" not in " ".join(lines)  # one seed measured: no spread, no verdict
    doc = {"stage": "screen", "command": "c", "table": table, "verdict": lines, "left": "nothing",
           "preset": {"quality": "tiny", "quality_set": {}, "temperatures": [0.0, 1.0]}, "train_s": 5.0,
           "steps": {"ce+decay": 10}, "step_s": {"ce+decay": 0.5},
           "mixes": {"greedy": {"rows": 4, "prompts": 4, "answer_chars_mean": 10.0},
                     "sampling": {"temperature": 1.0, "top_p": 1.0, "samples_per_prompt": 2}}}
    md = ra.markdown(doc)
    assert "| candidate | seeds | steps | tokens (M) | τ heldout T=0 | τ heldout T=1 | τ other T=0 | τ other T=1 |" in md
    assert "| kl/both | 3/3 [0, 1, 2] | [10, 10, 10] | 2.00 | 3.200 ± 0.100 (3.100-3.300); 1.60x |" in md
    assert "data: greedy 4 rows of 4 prompts" in md and "what the table cannot say" in md


def test_a_stage_planned_with_other_figures_is_refused_in_one_line(tmp_path):
    p = ra.Preset()
    doc = ra.stage_doc(p, tmp_path, "cmd")
    ra.write_json(tmp_path / "state.json", doc)
    assert ra.stage_doc(ra.Preset(call_s=300.0), tmp_path, "cmd")["planned"] == doc["planned"]  # a call's own budget
    with pytest.raises(SystemExit, match=r"was planned with other candidates, seeds \(candidates=.*seeds=\[0, 1, 2\]\)"):
        ra.stage_doc(ra.Preset(seeds=(0, 1), candidates=("ce+decay/greedy",)), tmp_path, "cmd")


def test_the_command_line_refuses_unknown_fields_candidates_and_a_single_seed(capsys):
    ap = ra.parser()

    def preset(*argv):
        return ra.preset_of(ap, ap.parse_args(["--out", "x", *argv]))

    assert preset("--candidates", "ce+decay/greedy, kl/sampled").candidates == ("ce+decay/greedy", "kl/sampled")
    assert preset("--set", "seeds=[3,4]", "--call-s", "300").seeds == (3, 4)
    for argv, message in ((["--set", "nope=1"], "no preset field 'nope'"),
                          (["--candidates", "kl/mixed"], "candidate 'kl/mixed': expected OBJECTIVE/DATA"),
                          (["--candidates", "kl/both"], "baseline 'ce+decay/greedy' is not one of the candidates"),
                          (["--set", "seeds=[0]"], "a spread needs at least 2"),
                          # a run's directory is its candidate and seed: named twice, two trainers would share one
                          (["--candidates", "ce+decay/greedy,kl/both,kl/both"], "kl/both named twice"),
                          (["--set", "seeds=[0, 1, 0]"], "seeds [0, 1, 0]: 0 named twice"),
                          (["--set", "seeds=[0, ../x]"], "seeds [0, '../x']: integers only"),
                          (["--stage", "../../x"], "--stage '../../x': letters, digits"),
                          # more of each prompt's sampled answers than the data holds
                          (["--candidates", "ce+decay/greedy,kl/both3", "--set", "samples_per_prompt=2"],
                           "candidate 'kl/both3': 3 sampled answers of each prompt, the data holds 2")):
        with pytest.raises(SystemExit):
            preset(*argv)
        assert message in capsys.readouterr().err


def test_the_next_command_names_the_output_under_out(monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    line = ra.next_command(["--preset", "h200", "--out", str(tmp_path / "recipe"), "--set", "seeds=[0, 1]"])
    assert line == ("PYTHONUNBUFFERED=1 PYTHONPATH=. python bench/recipe_ablation.py --preset h200 --out $OUT/recipe "
                    "--set 'seeds=[0, 1]'")


def test_idle_evaluates_each_finished_run_once_while_an_evaluation_fits_before_the_deadline(tmp_path):
    """Runs.idle (run_all calls it once every queued run has started): the runs with all their steps and no τ
    are evaluated, each once, and the state is written at once; with no room for an evaluation before the
    deadline (the call's end less the reserve), none. The checkpoint evaluator is a stand-in (τ itself is
    the slow CPU test's); what is under test is which runs are evaluated, when, and that the state keeps it."""
    import dataclasses

    p = ra.PRESETS["cpu"]
    stage = tmp_path / "stage"
    cells = {"tau": 2.0, "tau_expected": 2.0, "tau_lookup": 1.6, "tau_ratio": 1.25}
    point = {"step": 10, "acceptance": [0.6],
             "tau_by_set": {s: {"tau_by_temperature": {"0": cells, "1": cells}, "tau_by_repetition": {"0": {}}}
                            for s in ra.SETS},
             "tau_by_proposals": {"probabilistic": {s: {"0": cells, "1": cells} for s in ra.SETS}}}
    evaluated = []

    def evaluator(ck, temperatures, proposals):
        evaluated.append(ck)
        return point

    def runs_at(call_end):
        doc = ra.stage_doc(p, stage, "cmd")
        doc.update(stage="s", preset=dataclasses.asdict(p), call_end=call_end)
        for name, step in (("ce+decay greedy seed 0", 10), ("ce+decay greedy seed 1", 4)):
            doc["runs"][name] = {"candidate": "ce+decay/greedy", "seed": int(name[-1]), "legs": [], "failures": 0,
                                 "planned": 10, "step": step}
            ck = stage / "runs" / name.replace(" ", "-") / "checkpoints" / f"step_{step}"
            ck.mkdir(parents=True, exist_ok=True)
            (ck / "manifest.json").write_text("{}")
        runs = ra.Runs(p, ra.quality_preset(p), tmp_path, stage, doc, tmp_path / "out")
        runs.evaluator = evaluator
        return runs

    (tmp_path / "out").mkdir()
    late = runs_at(time.time() + p.reserve_s + p.eval_s - 1)  # an evaluation would end past the deadline
    late.idle()
    assert evaluated == [] and not (stage / "state.json").exists()
    runs = runs_at(time.time() + 100)
    runs.idle()
    runs.idle()  # called again at the next poll: nothing left to evaluate
    assert evaluated == [stage / "runs" / "ce+decay-greedy-seed-0" / "checkpoints" / "step_10"]
    saved = json.loads((stage / "state.json").read_text())["runs"]
    assert saved["ce+decay greedy seed 0"]["result"]["by_set"]["heldout"]["1 sampled"] == cells
    assert "result" not in saved["ce+decay greedy seed 1"]  # 4 of 10 steps: not evaluated


def test_a_leg_stop_is_written_once_the_run_reaches_its_step(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    ra.write_json(run / "status.json", {"state": "running", "step": 2})
    with ra.LegStops([{"run_dir": run, "stop_at": 3, "planned": 6}, {"run_dir": tmp_path / "whole", "stop_at": 6,
                                                                     "planned": 6}]) as stops:
        time.sleep(0.2)
        assert not (run / "control" / "stop").exists()
        ra.write_json(run / "status.json", {"state": "running", "step": 3})
        for _ in range(100):
            if (run / "control" / "stop").exists():
                break
            time.sleep(0.05)
    assert json.loads((run / "control" / "stop").read_text()) == {"id": "recipe-leg"}
    assert len(stops.jobs) == 1  # a run trained whole in this call has no stop to write


@pytest.mark.slow
def test_the_cpu_plan_spans_two_calls_and_the_second_continues_what_the_first_left(tmp_path, capsys):
    state = tmp_path / "state"
    argv = ["--preset", "cpu", "--state", str(state)]
    first = ra.main([*argv, "--out", str(tmp_path / "out1")])
    printed = capsys.readouterr().out
    assert "next: PYTHONUNBUFFERED=1 PYTHONPATH=. python bench/recipe_ablation.py --preset cpu --state" in printed
    prep = json.loads((state / "prep.json").read_text())
    assert prep["sampled"]["done"] and {k: prep["mixes"][k]["rows"] for k in ra.DATA_MIXES} == {
        "greedy": 12, "sampled": 24, "both": 36}
    made = [*(state / "model").iterdir(), *(state / "data").glob("*.jsonl")]
    stamps = {f: f.stat().st_mtime_ns for f in made}
    steps = first["steps"]
    # equal device time: base_steps of the baseline's step time, each objective as many steps as cost the same
    assert (first["train_s"], steps) == ra.steps_of(10 * first["step_s"]["ce+decay"], first["step_s"], 40)
    assert len(first["runs"]) == 4
    stopped = {}  # each run stops at the first step boundary after its leg's end that sees the request
    for name, r in first["runs"].items():
        half = ra.leg_end(0, r["planned"], 2)
        if r["step"] == r["planned"]:  # a run of 1-3 steps (a CPU shared by other work can time the rival that
            # slow) may reach its last step before the stop is served: done in this call, and evaluated
            assert r["planned"] <= 3 and r["result"]["step"] == r["planned"]
            continue
        stopped[name] = r["step"]
        assert half <= r["step"] < r["planned"] and "result" not in r
        assert r["legs"] == [{"call": 1, "from": 0, "to": r["step"], "exit": 0, "seconds": r["legs"][0]["seconds"]}]
    assert "ce+decay greedy seed 0" in stopped and "ce+decay greedy seed 1" in stopped

    second = ra.main([*argv, "--out", str(tmp_path / "out2")])
    printed = capsys.readouterr().out
    assert "done: every run trained and evaluated" in printed and "next:" not in printed
    assert "corpus:" not in printed and "sampled answers:" not in printed and "step time alone" not in printed
    evaluated = [line for line in printed.splitlines() if ": τ heldout T=0 " in line]
    assert evaluated and all(line.split(": τ ")[0] in second["runs"] and "heldout T=1 sampled " in line
                             for line in evaluated), evaluated  # each evaluated run's line under its own name
    assert {f: f.stat().st_mtime_ns for f in made} == stamps  # nothing prepared or regenerated again
    assert second["step_s"] == first["step_s"] and second["steps"] == steps
    for name, r in second["runs"].items():
        starts = [e for e in read_events(state / "stages" / "screen" / "runs" / name.replace(" ", "-"))
                  if e["event"] == "start"]
        assert r["step"] == r["planned"]
        if name in stopped:  # resumed from the checkpoint its first leg left
            half = stopped[name]
            assert [(leg["call"], leg["from"], leg["to"]) for leg in r["legs"]] == [(1, 0, half), (2, half, r["planned"])]
            assert [e.get("resumed_from") for e in starts] == [None, f"checkpoints/step_{half}"]
        else:  # finished in the first call: never started again
            assert len(starts) == 1 and len(r["legs"]) == 1
        assert set(r["result"]["by_set"]) == {"heldout", "other"} and r["result"]["step"] == r["planned"]
        assert {s: sum(b["prompts"] for b in by["0"].values()) for s, by in r["result"]["by_repetition"].items()} == \
            {"heldout": 3, "other": 3}  # T = 0 by how much of the answer repeats its text: every prompt once
        # each run evaluated with argmax proposals and, at T = 1, sampled ones; lookup (argmax) alike in both
        assert all(set(by_t) == {"0", "1", "1 sampled"} for by_t in r["result"]["by_set"].values())
        assert all(by_t["1 sampled"]["tau_lookup"] == by_t["1"]["tau_lookup"] for by_t in r["result"]["by_set"].values())
    # a mix is tokenized once (data.token_cache): the greedy one by the step timing, whose file is its first 512
    # rows (all 12 here), `both` by its first run's first start; every other start reads it
    logs = [(d / "train.log").read_text() for d in (state / "stages" / "screen" / "runs").iterdir() if d.is_dir()]
    starts = sum(len(r["legs"]) for r in second["runs"].values())
    assert sum(log.count("kept in data.token_cache") for log in logs) == 1
    assert sum(log.count("tokenized conversations from data.token_cache") for log in logs) == starts - 1
    for e in second["table"].values():
        assert e["measured"] == 2 and e["seeds"] == [0, 1]
        for key in ("heldout T=0", "heldout T=1", "heldout T=1 sampled", "other T=0", "other T=1", "other T=1 sampled"):
            assert e[key]["tau"]["n"] == 2 and e[key]["tau"]["mean"] >= 1.0 and e[key]["ratio"]["mean"] > 0
    md = (tmp_path / "out2" / "recipe.md").read_text()
    assert "| τ heldout T=1 | τ heldout T=1 sampled | τ other T=0 |" in md
    assert f"| ce+decay/greedy | 2/2 [0, 1] | [{steps['ce+decay']}, {steps['ce+decay']}] |" in md and "sampled 24 rows of 12 prompts" in md
    assert json.loads((tmp_path / "out2" / "recipe.json").read_text())["mixes"]["both"]["rows"] == 36
    # where each candidate stands against #50's goal, in the table and the call's output
    assert [line.split(" (")[0] for line in second["goal"]] == list(second["table"])
    assert all(f"* goal: {line}" in md and f"goal: {line}" in printed for line in second["goal"])

    third = ra.main([*argv, "--out", str(tmp_path / "out3")])  # nothing left: nothing trained or evaluated again
    assert "call 3: 0 runs to train" in capsys.readouterr().out
    assert third["table"] == second["table"]


@pytest.mark.slow
def test_a_preparation_cut_short_is_resumed_by_the_next_call_and_no_run_starts_on_part_of_the_data(tmp_path, capsys):
    """regen_legs=2: the first call's greedy regen answers half the prompts (as a deadline's SIGINT would cut
    it): that call trains nothing and says what the data holds; the next call resumes the same regen (the
    first half kept as written, the target not made again), then the sampled answers and the mixes of all
    the planned prompts, and only then the runs."""
    state = tmp_path / "state"
    argv = ["--preset", "cpu", "--state", str(state), "--set", "regen_legs=2"]
    first = ra.main([*argv, "--out", str(tmp_path / "out1")])
    printed = capsys.readouterr().out
    assert "greedy answers: exit 0; 12 of 24 prompts answered [" in printed and "the next call resumes them" in printed
    assert "sampled answers:" not in printed and "step time alone" not in printed and "call 1:" not in printed
    assert "left: the data (greedy answers: 12 of 24 prompts; the next call resumes it" in printed
    assert "next: PYTHONUNBUFFERED=1 PYTHONPATH=. python bench/recipe_ablation.py --preset cpu" in printed
    assert first["runs"] == {} and "mixes" not in first and "steps" not in first
    assert first["data"]["greedy"] == {"rows": 12, "planned": 24, "done": False, "calls": 1,
                                       "seconds": first["data"]["greedy"]["seconds"]}
    assert "data: not whole yet, no run started: greedy answers 12 of 24 prompts" in (tmp_path / "out1" / "recipe.md").read_text()
    model = {f: f.stat().st_mtime_ns for f in (state / "model").iterdir()}
    kept = (state / "data" / "regen.jsonl").read_text()

    second = ra.main([*argv, "--out", str(tmp_path / "out2")])
    printed = capsys.readouterr().out
    assert "corpus:" not in printed and "target step" not in printed  # the target is not made again
    assert {f: f.stat().st_mtime_ns for f in (state / "model").iterdir()} == model
    assert "greedy answers: exit 0; 24 of 24 prompts answered [" in printed
    answers = (state / "data" / "regen.jsonl").read_text()
    assert answers.startswith(kept)  # the first call's answers as written, the rest added
    ids = [json.loads(line)["id"] for line in answers.splitlines()]
    prompts = [json.loads(line)["id"] for line in (state / "data" / "prompts.jsonl").read_text().splitlines()]
    assert sorted(ids) == sorted(prompts) and len(ids) == 24
    assert "sampled answers: exit 0; 24 of 24 rows" in printed and "call 2: 4 runs to train" in printed
    assert second["data"]["greedy"]["done"] and second["data"]["greedy"]["calls"] == 2
    assert {k: (second["mixes"][k]["rows"], second["mixes"][k]["prompts"], second["mixes"][k]["planned"])
            for k in ra.DATA_MIXES} == {"greedy": (12, 12, 12), "sampled": (24, 12, 12), "both": (36, 12, 12)}
    assert all(r["step"] > 0 for r in second["runs"].values()) and len(second["runs"]) == 4
    assert "data: greedy 12 rows of 12 prompts (of 12 planned;" in (tmp_path / "out2" / "recipe.md").read_text()


def test_regen_is_given_only_the_batches_that_end_before_the_deadline(monkeypatch):
    monkeypatch.setattr(ra.time, "time", lambda: 1000.0)
    # 250 s left, 100 s a batch: two batches of 16,384 rows, 2 a prompt -> 16,384 more prompts
    assert ra.prompts_that_fit(8192, 16384, 2, 100.0, 1250.0) == 8192 + 16384
    assert ra.prompts_that_fit(0, 16384, 1, 100.0, 1099.0) == 0  # no batch fits: nothing to start
    assert ra.prompts_that_fit(0, 16384, 1, 100.0, 900.0) == 0  # past the deadline
    p = ra.PRESETS["h200-data"]
    # a sampled batch costs what the greedy answers measured a row (model load in), or the stated figure if more
    assert ra.sampled_batch_s(p, {"rows": 16384, "seconds": 141.0}, 32768) == pytest.approx(141.0)
    assert ra.sampled_batch_s(p, {"rows": 16384, "seconds": 10.0}, 32768) == p.sampled_s / 2


@pytest.mark.slow
def test_a_call_without_the_time_for_a_regen_batch_starts_none_and_ends_early(tmp_path, capsys):
    """A batch the deadline would cut is lost whole with its device time: a call with less time left than a
    batch takes starts no regen, writes no answers, trains nothing and names the next command; one with time
    for some of the batches gives regen those alone (--limit) and leaves the rest to the next call."""
    state = tmp_path / "state"
    argv = ["--preset", "cpu", "--state", str(state)]
    ra.main([*argv, "--set", "greedy_s=1e9", "--out", str(tmp_path / "out1")])
    printed = capsys.readouterr().out
    assert "greedy answers: a batch takes ~500000000s (stated)" in printed and "the next call makes them" in printed
    assert not (state / "data" / "regen.jsonl").exists() and "call 1:" not in printed
    assert "left: the data (no greedy answers yet" in printed and "next: PYTHONUNBUFFERED=1" in printed

    # ~890 s left and 600 s a sampled batch (2 batches of 12 rows stated at 1,200 s): one batch, then the call ends
    second = ra.main([*argv, "--set", "sampled_s=1200", "--out", str(tmp_path / "out2")])
    printed = capsys.readouterr().out
    assert "greedy answers: exit 0; 24 of 24 prompts answered [" in printed
    assert "sampled answers: exit 0; 12 of 24 rows" in printed and "the next call resumes them" in printed
    assert second["runs"] == {} and "call 2:" not in printed
    assert "--limit 6" in json.loads((state / "prep.json").read_text())["sampled"]["command"]  # 6 prompts, 2 a prompt

    third = ra.main([*argv, "--set", "sampled_s=1e9", "--out", str(tmp_path / "out3")])
    printed = capsys.readouterr().out
    assert "sampled answers: a batch takes ~500000000s" in printed and "sampled answers: exit" not in printed
    assert len((state / "data" / "regen-sampled.jsonl").read_text().splitlines()) == 12 and third["runs"] == {}


def test_the_h200_runs_trainer_configs_parse_and_differ_in_objective_data_and_seed_alone(tmp_path):
    import yaml

    from trainer.run.config import parse_config

    p = ra.PRESETS["h200"]
    qp = ra.quality_preset(p)
    assert qp.n_prompts == p.mix_prompts == 8192 and qp.parallel == p.parallel == 6
    configs = {(c, s): ra.trainer_config(p, qp, tmp_path, c, s, 1000) for c in p.candidates for s in p.seeds}
    base = configs[("ce+decay/greedy", 0)]
    for (candidate, seed), cfg in configs.items():
        objective, data, *_ = ra.candidate_parts(candidate)
        assert cfg["data"]["train_path"] == str(tmp_path / "data" / f"mix-{data}.jsonl")
        assert cfg["run"]["seed"] == cfg["data"]["seed"] == seed and cfg["optim"]["total_steps"] == 1000
        assert cfg["data"]["token_cache"] == str(tmp_path / "tokenized")  # the seeds of a mix tokenize it once
        assert {k: v for k, v in cfg["model"].items() if k not in ("loss", "position_weight")} == \
            {k: v for k, v in base["model"].items() if k not in ("loss", "position_weight")}
        assert cfg["optim"] == base["optim"] and cfg["eval"] == base["eval"] and cfg["pipeline"] == base["pipeline"]
        cfg["devices"] = {"target": ["cpu"], "drafter": ["cpu"]}  # parse on a machine without CUDA
        c = parse_config(yaml.safe_dump(cfg))
        assert (c.model.loss, c.model.position_weight) == (
            {"ce+decay": ("ce", "decay"), "ce+dpace": ("ce", "dpace"), "kl": ("kl", "decay")}[objective])


def test_the_default_preset_trains_the_one_call_recipe_s_data_and_objective_beside_one_rival(tmp_path):
    import yaml

    from bench import quality
    from trainer.run.config import parse_config

    p = ra.PRESETS["h200-default"]
    recipe = quality.PRESETS["h200-recipe"]  # the one-call recipe whose τ the done-when asks over 3 seeds
    qp = ra.quality_preset(p)
    assert qp.n_prompts == p.mix_prompts == recipe.n_prompts and p.samples_per_prompt == recipe.sampled_answers
    assert p.baseline == "ce+dpace/both" and len(p.seeds) == 3 and ra.uses_sampled(p)
    parsed = {}
    for candidate in p.candidates:
        cfg = ra.trainer_config(p, qp, tmp_path, candidate, 0, 1000)
        cfg["devices"] = {"target": ["cpu"], "drafter": ["cpu"]}
        c = parse_config(yaml.safe_dump(cfg))
        parsed[candidate] = (c.model.loss, c.model.position_weight, c.model.drafter.kind)
    # the rival is the default with a DFlash2 drafter: the generation alone differs
    assert parsed == {"ce+dpace/both": ("ce", "dpace", "dflash"), "ce+dpace/both/dflash2": ("ce", "dpace", "dflash2")}
    # the plan from the stated figures: the data in the first call, each run ~2 minutes of the device alone
    plan = ra.plan_only(p)
    assert ra.data_s(p) < p.call_s and 100.0 < plan["train_s"] < 200.0


def test_the_goal_names_each_cell_short_of_it_and_a_temperature_counts_its_best_proposals():
    p = ra.Preset(candidates=("ce+dpace/both", "kl+dpace/both"), seeds=(0, 1), proposals=("greedy", "probabilistic"))

    def run(candidate, seed, tau0, tau1, tau1_sampled, other0, other1):
        r = result(tau0, tau1, other0, other1)  # lookup: held-out 2.0 / 1.5, other 1.6 / 1.2 at T = 0 / 1
        r["by_set"]["heldout"]["1 sampled"] = {"tau": tau1_sampled, "tau_lookup": 1.5, "tau_ratio": tau1_sampled / 1.5}
        return {"candidate": candidate, "seed": seed, "failures": 0, "result": r}

    runs = {"a0": run("ce+dpace/both", 0, 3.0, 2.0, 2.4, 2.4, 1.8), "a1": run("ce+dpace/both", 1, 3.4, 2.1, 2.6, 2.6, 2.0),
            # argmax proposals short at T = 1 held-out (1.40x), sampled ones over the goal (2.13x): met
            "b0": run("kl+dpace/both", 0, 4.2, 2.1, 3.2, 2.6, 2.0), "b1": run("kl+dpace/both", 1, 4.0, 2.1, 3.2, 2.6, 2.0)}
    lines = ra.goal_lines(ra.summarise(p, runs))
    assert lines[1] == "kl+dpace/both (2 seeds): meets #50's goal in every cell"
    # held-out T = 0: 1.60x mean (1.50-1.70) short of 2.0x; T = 1's best column 1.67x (sampled); the other style
    # 1.56x and 1.58x short of 1.6x
    assert lines[0] == ("ce+dpace/both (2 seeds): short of #50's goal at heldout T=0 1.60x (1.50-1.70, goal 2x); "
                        "heldout T=1 1.67x (1.60-1.73, goal 2x); other T=0 1.56x (1.50-1.62, goal 1.6x); "
                        "other T=1 1.58x (1.50-1.67, goal 1.6x)")


@pytest.mark.parametrize("preset, rows", [
    ("h200-data", {"both1": (3, 3), "sampled": (0, 6)}),  # each prompt's greedy answer traded for a sampled one
    ("h200-mix", {"sampled": (0, 6), "both": (3, 6)}),  # none of the rows greedy, or a third
])
def test_the_data_presets_differ_in_the_greedy_share_of_the_same_prompts_answers(tmp_path, preset, rows):
    import yaml

    from trainer.run.config import parse_config

    p = ra.PRESETS[preset]
    qp = ra.quality_preset(p)
    assert p.baseline in p.candidates and p.samples_per_prompt == 2 and qp.n_prompts == p.mix_prompts
    # one state serves both presets on one machine: the data they ask for is the same
    assert {f: getattr(p, f) for f in ra.DATA_FIELDS} == {f: getattr(ra.PRESETS["h200-data"], f) for f in ra.DATA_FIELDS}
    # the mixes of one prompt with both sampled answers: the two candidates hold as many rows
    records(tmp_path / "regen.jsonl", [conv(f"p{i}", "g") for i in range(3)])
    records(tmp_path / "regen-sampled.jsonl", [conv(f"p{i}#{k}", "s", prompt_id=f"p{i}", sample=k)
                                               for i in range(3) for k in range(2)])
    mixes = ra.write_mixes(dataclasses.replace(p, mix_prompts=3), tmp_path, 0)
    assert {ra.candidate_parts(c).data: (mixes[ra.candidate_parts(c).data]["greedy_rows"],
                                         mixes[ra.candidate_parts(c).data]["sampled_rows"]) for c in p.candidates} == rows
    parsed = {}
    for candidate in p.candidates:
        cfg = ra.trainer_config(p, qp, tmp_path, candidate, 0, 1000)
        cfg["devices"] = {"target": ["cpu"], "drafter": ["cpu"]}
        c = parse_config(yaml.safe_dump(cfg))
        parsed[candidate] = (c.data.train_path, c.model.loss, c.model.position_weight, c.model.drafter.kind)
    # the data alone differs: the default objective and generation
    assert parsed == {c: (str(tmp_path / "data" / f"mix-{ra.candidate_parts(c).data}.jsonl"), "ce", "dpace", "dflash")
                      for c in p.candidates}
