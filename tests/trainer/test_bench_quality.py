"""bench/quality.py end to end on CPU (the tiny preset): real Python sources, a fitted target saved
as a model directory, regen through the CLI, the trainer from that directory, τ and the ablation."""
import dataclasses
import hashlib
import json
import random
from pathlib import Path

import pytest
import yaml

from bench import quality


def test_test_files_are_left_out():
    assert quality.is_test_file(Path("unittest/test/test_case.py"))
    assert quality.is_test_file(Path("numpy/tests/helpers.py"))
    assert quality.is_test_file(Path("pkg/conftest.py"))
    assert quality.is_test_file(Path("pkg/thing_test.py"))
    assert not quality.is_test_file(Path("unittest/case.py"))
    assert not quality.is_test_file(Path("json/decoder.py"))


def test_windows_cut_at_line_boundaries_and_cover_the_file_in_order():
    import random

    text = "".join(f"line {i} = {i * i}\n" for i in range(200))
    pairs = list(quality.windows(text, random.Random(0), (40, 80), 120))
    assert len(pairs) > 5
    assert all(u.endswith("\n") and a.endswith("\n") for u, a in pairs)
    joined = "".join(u + a for u, a in pairs)
    assert text.startswith(joined[:1000]) and joined in text


def test_a_number_field_takes_what_float_reads_and_refuses_the_rest(capsys):
    ap = quality.parser()

    def preset(*sets: str) -> quality.Preset:
        return quality.preset_of(ap, ap.parse_args(["--out", "x", "--stop-after", "target",
                                                    *[a for s in sets for a in ("--set", s)]]))

    p = preset("target_lr=2e-3", "target_budget_s=60", "target_snapshots=[10, 20]")
    assert p.target_lr == 0.002 and p.target_budget_s == 60.0 and p.target_snapshots == (10, 20)
    with pytest.raises(SystemExit):
        preset("target_lr=fast")
    assert "--set target_lr=fast: target_lr is a number, not 'fast'" in capsys.readouterr().err
    sampled = preset("draft_sample_method=probabilistic")  # every evaluation's proposals, the runs' own too
    config = quality.trainer_config(sampled, Path("model"), Path("t.jsonl"), Path("data"), 10, {}, 5)
    assert config["eval"]["draft_sample_method"] == "probabilistic"
    with pytest.raises(SystemExit):
        preset("draft_sample_method=random")
    assert "draft_sample_method 'random': one of greedy, probabilistic" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # the last step's target is the bench's own
        preset("target_steps=100", "target_snapshots=[50, 100]")
    assert "each a step before the last, 1..99 (target_steps 100); not [100]" in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_quality_bench_runs_every_stage(tmp_path):
    r = quality.main(["--preset", "tiny", "--out", str(tmp_path), "--set", "ceiling=true",
                      "--set", "tau_from_checkpoints=true"])
    c = r["corpus"]
    assert c["roots"] == [str(tmp_path / "corpus")]  # generated: the same on every machine and at every commit
    assert c["train_files"] > 0 and c["heldout_files"] > 0 and c["skipped"]["test"] > 0
    t = r["target"]
    assert t["tokens_trained"] > 0 and t["lm_loss_heldout_rows"] > 0 and t["lm_loss_seen_train_rows"] > 0
    model = tmp_path / "model"
    assert json.loads((model / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    assert (model / "tokenizer.json").exists() and (model / "model.safetensors.index.json").exists()
    # held-out prompts come from held-out files only: none of them appears in a training prompt's file
    prompts = [json.loads(line) for line in open(tmp_path / "data" / "prompts.jsonl")]
    regen = [json.loads(line) for line in open(tmp_path / "data" / "regen.jsonl")]
    assert r["regen"]["exit"] == 0 and len(regen) == len(prompts) == r["prompts"]["prompts"]
    assert all(m["messages"][-1]["role"] == "assistant" for m in regen)
    assert all(m["messages"][-1]["content"].strip() for m in regen)  # answers in code, not just newlines
    m = r["main"]
    assert m["exit"] == 0 and m["steps"] == 2 and m["tau"] >= 1.0 and m["train_file"] == "regen.jsonl"
    assert len(m["histogram"]) == 16 and sum(m["histogram"]) > 0
    assert [x["step"] for x in r["curve"]] == [1, 2] and r["curve"][-1]["tau"] == pytest.approx(m["tau"])
    # τ beside n-gram prompt lookup on the same prompts: the trainer's eval and the bench's agree
    assert m["tau_lookup"] >= 1.0 and m["tau_ratio"] == pytest.approx(m["tau"] / m["tau_lookup"])
    assert all(x["tau_lookup"] == pytest.approx(m["tau_lookup"]) and x["lookup_same_output"] for x in r["curve"])
    a = r["ablations"]["original answers"]
    assert a["exit"] == 0 and a["tau"] >= 1.0
    # an ablation the bench evaluates is measured as the main run is: each prompt set at every temperature
    assert [list(a["tau_by_set"][name]["tau_by_temperature"]) for name in ("heldout", "other")] == [["0", "0.7", "1"]] * 2
    assert quality.other_by_temperature(a) == a["tau_by_set"]["other"]["tau_by_temperature"]
    assert "| ablation |" in (tmp_path / "quality.md").read_text()
    # τ per prompt-length bucket, the lookup baseline beside it, in the results and the report
    for point in r["curve"]:
        assert sum(b["prompts"] for b in point["tau_by_length"].values()) == point["samples"]
        assert all(b["tau_lookup"] is not None for b in point["tau_by_length"].values())
    assert "| prompt length | prompts | tau pooled |" in (tmp_path / "quality.md").read_text()
    # a third prompt set, of other forms than every training prompt, with τ and lookup's τ of its own
    other = [json.loads(line) for line in open(tmp_path / "data" / "other.jsonl")]
    assert r["prompts"]["other"]["prompts"] == len(other) > 0
    assert {row["form"] for row in other} == set(quality.OTHER_STYLES)
    train_prompts = {row["messages"][0]["content"] for row in prompts}
    assert not any(row["messages"][0]["content"] in train_prompts for row in other)
    for point in r["curve"]:
        assert set(point["tau_by_set"]) == {"heldout", "other"}
        assert point["tau_by_set"]["heldout"]["tau"] == pytest.approx(point["tau"])
        o = point["tau_by_set"]["other"]
        assert o["samples"] == len(other) and o["tau"] >= 1.0 and o["tau_lookup"] >= 1.0
        by_form = o["tau_by_form"]["0"]  # τ per form of prompt, lookup's beside, pooling to the set's
        assert set(by_form) == {row["form"] for row in other}
        assert sum(b["prompts"] for b in by_form.values()) == len(other)
        assert all(b["tau"] >= 1.0 and b["tau_lookup"] >= 1.0 for b in by_form.values())
        # and at T = 0 per bucket of how much of the answer repeats its text: every prompt in one bucket
        for name in ("heldout", "other"):
            b = point["tau_by_set"][name]
            by_repetition = b["tau_by_repetition"]["0"]
            assert set(by_repetition) <= {"under a third", "a third to two thirds", "two thirds or more"}
            assert sum(x["prompts"] for x in by_repetition.values()) == b["samples"]
            assert all(x["tau"] >= 1.0 and x["tau_lookup"] >= 1.0 for x in by_repetition.values())
    assert m["tau_by_set"] == r["curve"][-1]["tau_by_set"]
    assert "main drafter on the other prompts at T=0 by how much of the answer repeats its text: " in \
        (tmp_path / "quality.md").read_text()
    assert all(set(x.get("tau_by_set") or ("heldout", "other")) == {"heldout", "other"} for x in r["ablations"].values())
    assert "main drafter by prompt set: heldout tau" in (tmp_path / "quality.md").read_text()
    # τ at T = 0, 0.7 and 1.0 of the last checkpoint (the bench's own evaluation, kept when a deadline's stop
    # cuts the trainer's), sampled and expected, lookup's beside (issue #49)
    by_t = m["tau_by_temperature"]
    assert by_t == r["curve"][-1]["tau_by_temperature"] and by_t["0"]["tau"] == pytest.approx(r["curve"][-1]["tau"])
    assert all(point["tau_by_temperature"] is None for point in r["curve"][:-1])  # T = 0 alone: the curve's
    assert list(by_t) == ["0", "0.7", "1"] and by_t["0"]["tau"] == by_t["0"]["tau_expected"]
    assert all(t["tau_expected"] >= 1.0 and t["tau_lookup"] >= 1.0 for t in by_t.values())
    assert "| T | tau (sampled) | tau (expected) |" in (tmp_path / "quality.md").read_text()
    # and every prompt set at each temperature, lookup's τ on the same prompts beside (issue #50)
    for name in ("heldout", "other"):
        per_t = m["tau_by_set"][name]["tau_by_temperature"]
        assert list(per_t) == ["0", "0.7", "1"] and all(t["tau_lookup"] >= 1.0 and t["tau_ratio"] > 0 for t in per_t.values())
        # the target drafting for itself, measured once a set beside lookup: at T = 0 above any drafter's τ
        assert all(t["tau_ceiling_expected"] >= 1.0 for t in per_t.values()) and per_t["0"]["tau_ceiling"] >= per_t["0"]["tau"]
    assert m["tau_by_set"]["heldout"]["tau_by_temperature"]["1"]["tau"] == pytest.approx(by_t["1"]["tau"])
    assert "other-style prompts (data/other.jsonl) by temperature:" in (tmp_path / "quality.md").read_text()
    assert f"* main drafter against #50's goal: {quality.goal_text(m['tau_by_set'])}" in (tmp_path / "quality.md").read_text()


def test_split_is_by_file_content():
    corpus = quality.collect_sources(300_000, 64 * 1024, 300, 0)
    train = {hashlib.sha256(t.encode()).hexdigest() for t in corpus["train"]}
    held = {hashlib.sha256(t.encode()).hexdigest() for t in corpus["heldout"]}
    assert train and held and not train & held
    assert all(int(h[:8], 16) % 1000 < 300 for h in held)


def test_held_out_windows_leave_answer_tokens_within_max_length():
    """A held-out prompt longer than max_length leaves nothing to measure τ on: it is never chosen."""
    from trainer_tools.fixtures.hub_model import train_tokenizer

    text = "".join(f"value_{i} = compute(value_{i - 1}, {i})\n" for i in range(1, 400))
    tok = train_tokenizer("qwen3", [text], 300)
    p = quality.PRESETS["tiny"]
    short_prompt, long_prompt, answer = text[:60], text[:3000], text[3000:3400]
    assert quality.fits(tok, p, short_prompt, answer)
    assert not quality.fits(tok, p, long_prompt, answer)
    assert not quality.fits(tok, p, short_prompt, "x\n")  # too short an answer to measure anything


def test_a_regen_prompt_of_one_enormous_line_is_left_out_and_prompts_go_shortest_first(tmp_path):
    """One window of minified data in a regen batch widens all its rows' caches to its length (an H100's
    second batch of 16,384 decoded nothing in 60 s behind a 16,020-token prompt): regen prompts leave an
    answer within max_length, as held-out ones do, and batch by their token length."""
    from trainer_tools.fixtures.hub_model import train_tokenizer

    code = "".join(f"value_{i} = compute(value_{i - 1}, {i})\n" for i in range(1, 300))
    minified = "DATA = [" + ", ".join(f"'{i:x}'" for i in range(5000)) + "]\n" + code[:400]
    tok = train_tokenizer("qwen3", [code, minified], 300)
    p = quality.PRESETS["tiny"]
    corpus = {"train": [minified, code, minified, code], "heldout": [code]}
    stats = quality.write_prompts(p, tok, corpus, tmp_path, random.Random(0))["stats"]
    prompts = [r["messages"][0]["content"] for r in quality.read_records(tmp_path / "prompts.jsonl")]
    assert prompts and not any(u.startswith("DATA = [") for u in prompts)
    assert stats["windows_too_long"] >= 2 and stats["prompt_tokens_max"] + quality.MIN_EVAL_ANSWER <= p.max_length
    sizes = quality.prompt_tokens(tok, prompts)
    assert sizes == sorted(sizes) and max(sizes) == stats["prompt_tokens_max"]


def test_the_fp8_preset_trains_both_precisions_at_equal_steps_and_tells_their_trainer_configs_apart(tmp_path):
    p = quality.PRESETS["h200-fp8"]
    assert p.ablation_steps_as_main and p.parallel == len(p.ablations) == 4
    base = quality.trainer_config(p, tmp_path / "model", tmp_path / "t.jsonl", tmp_path, 100, {}, 50)
    fp8 = quality.trainer_config(p, tmp_path / "model", tmp_path / "t.jsonl", tmp_path, 100, p.ablations["fp8 target"], 50)
    assert base["model"]["target"] == {"path": str(tmp_path / "model")}
    assert fp8["model"]["target"] == {"path": str(tmp_path / "model"), "precision": "fp8"}
    assert {k: v for k, v in fp8.items() if k != "model"} == {k: v for k, v in base.items() if k != "model"}
    # the seed twins differ from their precision's run in the drafter's initialisation alone, not in the data
    for twin, of in (("base, drafter seed 1", base), ("fp8 target, drafter seed 1", fp8)):
        cfg = quality.trainer_config(p, tmp_path / "model", tmp_path / "t.jsonl", tmp_path, 100, p.ablations[twin], 50)
        assert cfg["run"]["seed"] == 1 != of["run"]["seed"] and cfg["data"] == of["data"]
        assert cfg["model"] == of["model"] and {k: v for k, v in cfg.items() if k != "run"} == \
            {k: v for k, v in of.items() if k != "run"}
    whole = quality.trainer_config(quality.Preset(target_precision="fp8"), tmp_path, tmp_path / "t.jsonl", tmp_path,
                                   10, {}, 5)
    assert whole["model"]["target"]["precision"] == "fp8"  # --set target_precision=fp8: the main run on FP8 features


def test_the_fp8_drafter_preset_differs_from_its_bf16_twin_in_the_drafters_precision_alone(tmp_path):
    p = quality.PRESETS["h200-fp8-drafter"]
    assert p.ablation_steps_as_main and p.parallel == len(p.ablations) == 4
    args = (p, tmp_path / "model", tmp_path / "t.jsonl", tmp_path, 100)
    base = quality.trainer_config(*args, {}, 50)
    for name, twin in (("fp8 drafter", base),
                       ("fp8 drafter, drafter seed 1", quality.trainer_config(*args, p.ablations["base, drafter seed 1"], 50))):
        fp8 = quality.trainer_config(*args, p.ablations[name], 50)
        assert fp8["model"].pop("drafter") == {"precision": "fp8"} and "drafter" not in twin["model"]
        assert fp8 == twin


def test_the_proposals_preset_tells_each_run_from_the_base_by_its_objective_or_generation_alone(tmp_path, capsys):
    from trainer.run.config import parse_config

    p = quality.PRESETS["h200-proposals"]
    assert p.ablation_steps_as_main and p.parallel == len(p.ablations) == 4 and p.tau_from_checkpoints
    assert p.draft_sample_method == "probabilistic" and 1.0 in p.temperatures and p.sampled_answers == 1
    args = (p, tmp_path / "model", tmp_path / "t.jsonl", tmp_path, 100)
    cpu = {"devices": {"target": ["cpu"], "drafter": ["cpu"]}}  # parse on a machine without CUDA

    def objective(cfg: dict) -> tuple:
        m = parse_config(yaml.safe_dump(cfg | cpu)).model
        return m.loss if isinstance(m.loss, str) else (m.loss.ce, m.loss.kl, m.loss.tv), m.position_weight

    base = quality.trainer_config(*args, p.ablations["base"], 50)
    assert objective(base) == ("ce", "dpace")  # the trainer's default objective
    for name, expected in (("kl+dpace", ("kl", "dpace")), ("ce+tv", ((1.0, 0.0, 1.0), "dpace"))):
        cfg = quality.trainer_config(*args, p.ablations[name], 50)
        assert objective(cfg) == expected
        assert {k: cfg["model"].pop(k) for k in ("loss", "position_weight")} == quality.OBJECTIVES[name]
        assert cfg == base  # nothing else differs
    dflash2 = quality.trainer_config(*args, p.ablations["dflash2"], 50)
    assert parse_config(yaml.safe_dump(dflash2 | cpu)).model.drafter.kind == "dflash2"
    assert dflash2["model"].pop("drafter") == {"kind": "dflash2"} and dflash2 == base
    ap = quality.parser()
    with pytest.raises(SystemExit):
        quality.preset_of(ap, ap.parse_args(["--out", "x", "--set", 'ablations={"a": {"objective": "ce+nope"}}']))
    assert "unknown objective {'a': 'ce+nope'}: an objective is one of ce+decay, " in capsys.readouterr().err


def test_the_levers_preset_crosses_the_generation_with_the_taps_and_nothing_else(tmp_path):
    from trainer.models.target import tapped_layer_ids
    from trainer.run.config import parse_config

    p, screen = quality.PRESETS["h200-levers"], quality.PRESETS["h200-proposals"]
    assert dataclasses.replace(p, ablations=screen.ablations) == screen  # the screen's call, other runs
    assert p.parallel == len(p.ablations) == 4 and p.ablation_steps_as_main
    args = (p, tmp_path / "model", tmp_path / "t.jsonl", tmp_path, 100)
    cpu = {"devices": {"target": ["cpu"], "drafter": ["cpu"]}}
    seen = set()
    for over in p.ablations.values():
        m = parse_config(yaml.safe_dump(quality.trainer_config(*args, over, 50) | cpu)).model
        taps = tuple(tapped_layer_ids(m.target_layer_ids, m.num_target_layers, p.layers))
        seen.add((m.drafter.kind, taps))
        assert (m.loss, m.position_weight, m.num_target_layers) == ("ce", "dpace", 3)
    assert seen == {(kind, taps) for kind in ("dflash", "dflash2") for taps in ((1, 3, 5), (1, 4, 7))}


def test_the_main_run_takes_its_own_overrides_and_is_then_no_ablation_s_base_row(tmp_path, capsys):
    ap = quality.parser()
    p = quality.preset_of(ap, ap.parse_args(["--preset", "h200-proposals", "--out", "x",
                                             "--set", "main_overrides={drafter_kind: dflash2, objective: kl+dpace}"]))
    row = {"id": "p0", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    (tmp_path / "t.jsonl").write_text(json.dumps(row) + "\n")
    (tmp_path / "original.jsonl").write_text(json.dumps(row) + "\n")
    jobs, base_is_main = quality.drafter_jobs(p, tmp_path / "model", tmp_path / "t.jsonl", tmp_path, tmp_path, 100)
    main = jobs[0]["cfg"]["model"]
    assert main["drafter"] == {"kind": "dflash2"} and main["loss"] == "kl" and main["position_weight"] == "dpace"
    # the ablations' base row keeps the defaults, so it trains as a run of its own
    assert not base_is_main and [j["name"] for j in jobs] == ["main", *p.ablations]
    assert "drafter" not in jobs[1]["cfg"]["model"] and "loss" not in jobs[1]["cfg"]["model"]
    # the target layers tapped, named: the last of the bench's 8 among them (the default stops at 1, 3, 5)
    deep = quality.preset_of(ap, ap.parse_args(["--preset", "h200-recipe", "--out", "x",
                                                "--set", "main_overrides={target_layer_ids: [1, 4, 7]}"]))
    model = quality.drafter_jobs(deep, tmp_path / "model", tmp_path / "t.jsonl", tmp_path, tmp_path, 100)[0][0]["cfg"]["model"]
    assert (model["target_layer_ids"], model["num_target_layers"]) == ([1, 4, 7], 3)
    for bad, says in (("main_overrides=kl", "main_overrides 'kl': a mapping"),
                      ("main_overrides={objective: nope}", "unknown objective {'main_overrides': 'nope'}"),
                      ("main_overrides={train: original}", "main_overrides: the main run trains on the regenerated"),
                      # a typo would train the defaults under the run's name; a value the trainer refuses would
                      # stop the run after the target and regen had spent the call's time
                      ("main_overrides={objectve: kl+dpace}", "unknown key(s) ['objectve']; an override is one of"),
                      ("main_overrides={drafter_kind: dflash3}", "the trainer refuses its config:"),
                      ("main_overrides={target_layer_ids: [1, 4, 8]}", "8 is not a layer of the 8-layer target"),
                      ("main_overrides={target_layer_ids: [4, 1]}", "the trainer refuses its config:"),
                      ('ablations={"a": {"drafter_layers": 0}}', "the trainer refuses its config:"),
                      # a run's name is its directory's: no path, not the main run's, no two alike
                      ('ablations={"../../x": {"drafter_layers": 1}}', "run name '../../x': letters, digits"),
                      ('ablations={"a/b": {"drafter_layers": 1}}', "run name 'a/b': letters"),
                      ('ablations={"main": {"drafter_layers": 1}}', "run name 'main' is the main run's"),
                      ('ablations={"a b": {"drafter_layers": 1}, "a-b": {"drafter_layers": 2}}', "a-b named twice")):
        with pytest.raises(SystemExit):
            quality.preset_of(ap, ap.parse_args(["--out", "x", "--set", bad]))
        assert says in capsys.readouterr().err


def test_sampled_answers_join_the_greedy_ones_each_prompt_s_samples_after_its_greedy_answer(tmp_path):
    r = quality.main(["--preset", "tiny", "--out", str(tmp_path), "--set", "sampled_answers=2", "--stop-after", "regen"])
    data = tmp_path / "data"
    assert r["regen"]["exit"] == 0 and r["regen_sampled"]["exit"] == 0
    greedy = quality.read_records(data / "regen.jsonl")
    assert r["regen_sampled"]["conversations"] == 2 * len(greedy) == 2 * r["prompts"]["prompts"]
    prompts = {"ids": [x["id"] for x in quality.read_records(data / "prompts.jsonl")]}
    both = quality.read_records(quality.training_answers(r["regen"], prompts, data))
    assert len(both) == 3 * len(greedy)
    for i, g in enumerate(greedy):  # the greedy answer, then samples 0 and 1 of the same prompt, drawn at T = 1
        group = both[3 * i: 3 * i + 3]
        assert group[0] == g and [(x["prompt_id"], x["sample"]) for x in group[1:]] == [(str(g["id"]), 0), (str(g["id"]), 1)]
        assert all(x["messages"][:-1] == g["messages"][:-1] for x in group[1:])
    assert sum(x["messages"][-1]["content"] != g["messages"][-1]["content"]
               for x, g in zip(both[1::3], greedy)) > len(greedy) // 2
    # the runs train on the mix; without sampled answers, on the greedy ones alone
    jobs, _ = quality.drafter_jobs(quality.PRESETS["tiny"], tmp_path / "model", data / "regen-both.jsonl", data,
                                   tmp_path / "runs", 2)
    assert jobs[0]["cfg"]["data"]["train_path"] == str(data / "regen-both.jsonl")
    (data / "regen-sampled.jsonl").unlink()
    assert quality.training_answers(r["regen"], prompts, data) == data / "regen.jsonl"
    for name in ("h200-proposals", "h200-recipe"):
        assert quality.PRESETS[name].sampled_answers == 1


def test_the_tau_cost_compares_both_last_checkpoints_against_the_bf16_target(tmp_path):
    import torch

    from trainer.run.checkpoint import CheckpointManager

    def job(name, precision):
        run = tmp_path / name
        CheckpointManager(run, keep=1).save(40, {"w": torch.zeros(1)}, {}, {}, {})  # a complete step_40
        target = {"path": "m", **({"precision": precision} if precision != "bf16" else {})}
        return {"name": name, "run_dir": run, "cfg": {"model": {"target": target}}}

    main, fp8, other = job("main", "bf16"), job("fp8 target", "fp8"), job("depth 1", "bf16")
    evaluated = {main["run_dir"] / "checkpoints" / "step_40": {"tau": 4.0, "step": 40, "tau_per_prompt": 3.9,
                                                                "samples": 64},
                 fp8["run_dir"] / "checkpoints" / "step_40": {"tau": 3.96, "step": 40, "tau_per_prompt": 3.8,
                                                               "samples": 64}}
    ablations = {"fp8 target": {"precision": "fp8"}, "depth 1": {"drafter_layers": 1}}
    results = {"ablations": {name: {"overrides": o} for name, o in ablations.items()}}
    assert quality.precision_runs(main, [main, fp8, other], ablations) == [main, fp8]  # "depth 1" differs in more
    assert quality.precision_runs(main, [main, other], ablations) == []  # no FP8 run: nothing to compare
    cost = quality.precision_cost(results, main, [main, fp8], evaluated,
                                  [main["run_dir"] / "checkpoints" / "step_40"])
    assert cost["tau_bf16"] == 4.0 and cost["tau_fp8"] == 3.96 and cost["fp8_over_bf16"] == pytest.approx(0.99)
    assert cost["runs"] == ["main", "fp8 target"] and cost["steps"] == [40, 40]
    assert quality.fp8_run(fp8) and not quality.fp8_run(main)
    assert quality.precision_cost(results, main, [], evaluated, []) is None  # no FP8 run: no figure
    assert cost["seed_spread"] == {} and quality.precision_line(cost).endswith("fp8/bf16 0.9900 (goal >= 0.98)")

    # a second drafter seed of each precision: the cost is the ratio of the means, the spread each one's own
    twin, fp8_twin = job("base, drafter seed 1", "bf16"), job("fp8 target, drafter seed 1", "fp8")
    evaluated[twin["run_dir"] / "checkpoints" / "step_40"] = {"tau": 4.2, "step": 40, "tau_per_prompt": 4.0, "samples": 64}
    evaluated[fp8_twin["run_dir"] / "checkpoints" / "step_40"] = {"tau": 4.0, "step": 40, "tau_per_prompt": 3.9,
                                                                  "samples": 64}
    ablations.update({twin["name"]: {"run_seed": 1}, fp8_twin["name"]: {"precision": "fp8", "run_seed": 1}})
    results["ablations"].update({name: {"overrides": ablations[name]} for name in (twin["name"], fp8_twin["name"])})
    assert cost["tau_fp8_served"] is None  # no FP8 run's own τ read back: none stated
    compared = quality.precision_runs(main, [main, fp8, other, twin, fp8_twin], ablations)
    assert compared == [main, fp8, twin, fp8_twin]  # the bf16 twin too, whose trainer measured a τ of its own
    cost = quality.precision_cost(results, main, compared, evaluated, [main["run_dir"] / "checkpoints" / "step_40"])
    assert cost["tau_bf16"] == pytest.approx(4.1) and cost["tau_fp8"] == pytest.approx(3.98)
    assert cost["fp8_over_bf16"] == pytest.approx(3.98 / 4.1)
    assert cost["seeds"]["bf16"] == {"main": 4.0, "base, drafter seed 1": 4.2}  # "depth 1" is not a twin
    assert cost["seed_spread"]["bf16"] == pytest.approx(0.2 / 4.1) and cost["seed_spread"]["fp8"] == pytest.approx(0.04 / 3.98)
    assert quality.precision_line(cost).endswith("fp8/bf16 0.9707 (goal >= 0.98) (means of 2 drafter seeds; their own "
                                                  "spread bf16 4.9 %, fp8 1.0 %)")
    # each FP8 run's own end-of-run τ (its trainer against its FP8 target): the drafters as an FP8 engine serves them
    results["ablations"]["fp8 target"]["tau_fp8_target"] = 4.05
    results["ablations"][fp8_twin["name"]]["tau_fp8_target"] = 4.15
    cost = quality.precision_cost(results, main, compared, evaluated, [main["run_dir"] / "checkpoints" / "step_40"])
    assert cost["tau_fp8_served"] == pytest.approx(4.1) and cost["fp8_served_over_bf16"] == pytest.approx(1.0)
    assert quality.precision_line(cost).endswith("; the fp8 drafters served by the FP8 target 4.100 (1.0000 of bf16's)")
    # which last checkpoints the bench evaluates itself: every compared run's, though its trainer measured τ;
    # an FP8 run's outside the comparison too (its own τ is against the FP8 target); not a finished bf16 run's
    from trainer.run.rundir import RunDir

    fp8_deeper = job("fp8, depth 1", "fp8")
    for j in (main, fp8, other, twin, fp8_twin, fp8_deeper):
        RunDir(j["run_dir"], total_steps=40).event("eval", 40, tau=3.0)
    assert [j["name"] for j in (fp8, other, twin, fp8_twin, fp8_deeper)
            if quality.bench_evaluates(j, compared, False)] == ["fp8 target", "base, drafter seed 1",
                                                                 "fp8 target, drafter seed 1", "fp8, depth 1"]
    assert quality.bench_evaluates(other, compared, True)  # tau_from_checkpoints: every run
    # a compared run whose checkpoint the bench had no time to evaluate is named, not silently dropped
    del evaluated[twin["run_dir"] / "checkpoints" / "step_40"]
    cost = quality.precision_cost(results, main, compared, evaluated, [main["run_dir"] / "checkpoints" / "step_40"])
    assert cost["unevaluated"] == ["base, drafter seed 1"] and cost["tau_bf16"] == 4.0
    assert quality.precision_line(cost).endswith("; left out, their last checkpoint not evaluated in time: "
                                                  "base, drafter seed 1")


def test_long_documents_concatenate_one_package_files_in_path_order():
    import random

    texts = [f"# {d} file {i}\n" + "x = 1\n" * 40 for d in ("b", "a") for i in range(4)]
    dirs = ["pkg/b"] * 4 + ["pkg/a"] * 4
    docs = quality.long_documents(texts, dirs, (500, 500), random.Random(0))  # 252 chars a file: two a document
    assert len(docs) == 4 and all(len(d) == 500 for d in docs)
    assert [d[:10] for d in docs] == ["# a file 0", "# a file 2", "# b file 0", "# b file 2"]  # directories sorted
    assert "# b" not in docs[0] + docs[1] and "# a file 1" in docs[0]  # one package's files together


def test_long_held_out_prompts_fall_in_every_length_bucket():
    """The long preset's held-out set: prompts in each range, every one of them in its τ bucket
    (trainer.run.contract.length_bucket of the rendered prompt), cut at line boundaries."""
    import random

    from trainer.run.contract import PROMPT_LENGTH_BUCKETS, length_bucket
    from trainer_tools.fixtures.hub_model import train_tokenizer

    text = "".join(f"def f_{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(12000))
    tok = train_tokenizer("qwen3", [text[:20000]], 400)
    p = quality.PRESETS["cpu-long"]
    assert len(p.eval_prompt_tokens) == len(PROMPT_LENGTH_BUCKETS) == len(p.eval_per_bucket)
    groups = quality.long_pairs(tok, [text], p.eval_prompt_tokens, p.eval_per_bucket, random.Random(0), 400)
    assert [len(g) for g in groups] == list(p.eval_per_bucket)
    for (name, _), (lo, hi), pairs in zip(PROMPT_LENGTH_BUCKETS, p.eval_prompt_tokens, groups):
        for user, answer in pairs:
            [n] = quality.prompt_tokens(tok, [user])
            assert lo <= n <= hi and length_bucket(n) == name and user.endswith("\n") and text.startswith(user + answer)
    # the H200 preset's ranges lie inside the buckets too
    h = quality.PRESETS["h200-long"]
    assert [length_bucket(lo) for lo, _ in h.eval_prompt_tokens] == [name for name, _ in PROMPT_LENGTH_BUCKETS]
    assert [length_bucket(hi) for _, hi in h.eval_prompt_tokens] == [name for name, _ in PROMPT_LENGTH_BUCKETS]


def test_the_long_preset_trainer_configs_are_valid_and_only_the_layout_differs(tmp_path):
    from trainer.run.config import parse_config

    p = quality.PRESETS["h200-long"]
    assert set(p.ablations) == {"base", "sliding 2048"} and p.ablation_steps_as_main and p.tau_from_checkpoints
    full = quality.trainer_config(p, tmp_path / "model", tmp_path / "t.jsonl", tmp_path, 100, {}, 100)
    swa = quality.trainer_config(p, tmp_path / "model", tmp_path / "t.jsonl", tmp_path, 100, p.ablations["sliding 2048"], 100)
    assert swa["model"]["drafter"] == {"layer_types": ["sliding_attention"] * 2, "sliding_window": 2048}
    assert "drafter" not in full["model"] and {k: v for k, v in swa.items() if k != "model"} == \
        {k: v for k, v in full.items() if k != "model"}
    mixed = quality.trainer_config(p, tmp_path, tmp_path / "t.jsonl", tmp_path, 100,
                                   quality.MORE_ABLATIONS["sliding 2048 + full"], 100)
    assert mixed["model"]["drafter"]["layer_types"] == ["sliding_attention", "full_attention"]
    assert full["data"]["eval_path"] == str(tmp_path / "eval-short.jsonl")  # the trainer's own τ: the short prompts
    for cfg in (full, swa, mixed):
        cfg["devices"] = {"target": ["cpu"], "drafter": ["cpu"]}  # parse on a machine without CUDA
        c = parse_config(yaml.safe_dump(cfg))
        assert c.data.pack_length == c.data.max_length == 16896 and c.data.pack_length % 128 == 0


def test_a_queued_run_that_would_not_finish_before_the_deadline_is_not_started(tmp_path, capsys):
    import time

    p = quality.Preset(inprocess=True)
    jobs = [{"name": f"run {i}", "argv": [], "log": tmp_path / f"{i}.log", "expect_s": 100.0} for i in range(2)]
    ended = []
    quality.run_all(p, jobs, time.time() + 30.0, on_done=ended.append)
    assert [j["rc"] for j in jobs] == [None, None] and ended == [] and not any(j["log"].exists() for j in jobs)
    import re

    assert re.search(r"trainer run 'run 0' not started: \d+s left, it needs ~100s", capsys.readouterr().out)


def test_idle_work_waits_until_every_run_has_started_and_stops_at_the_deadline(tmp_path):
    """on_idle (the recipe ablation evaluates finished runs there) runs while the last runs train, never
    while a run waits to start, and not once the deadline has passed. Real processes (a sleep), first one at
    a time, then two at once past the deadline."""
    import time

    p = quality.Preset(parallel=1)
    jobs = [{"name": f"run {i}", "module": "timeit", "argv": ["-n", "1", "-r", "1", "import time; time.sleep(1.5)"],
             "log": tmp_path / f"{i}.log", "run_dir": tmp_path / f"r{i}"} for i in range(2)]
    seen = []
    quality.run_all(p, jobs, time.time() + 120.0, on_done=lambda j: seen.append(("ended", j["name"])),
                    first_alone=False, on_idle=lambda: seen.append(("idle", [("started" in j) for j in jobs])))
    idle = [i for i, (what, _) in enumerate(seen) if what == "idle"]
    assert idle and all(seen[i][1] == [True, True] for i in idle)
    assert seen.index(("ended", "run 0")) < idle[0] < seen.index(("ended", "run 1"))  # while run 1 trains
    assert all(j["rc"] == 0 for j in jobs)

    # both start together and the deadline comes while they run; they finish their sleep after its SIGTERM
    late = [{"name": f"late {i}", "module": "timeit", "log": tmp_path / f"late{i}.log", "run_dir": tmp_path / f"late{i}",
             "argv": ["-n", "1", "-r", "1", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                      "time.sleep(2.5)"]} for i in range(2)]
    calls, deadline = [], time.time() + 1.2
    quality.run_all(dataclasses.replace(p, parallel=2), late, deadline, first_alone=False,
                    on_idle=lambda: calls.append(time.time()))
    assert all("terminated" in j and j["rc"] == 0 for j in late)  # the deadline's SIGTERM, then their own end
    assert calls and all(t <= deadline for t in calls)  # idle work while they ran, none after the deadline


def test_a_budget_that_leaves_the_drafters_no_time_is_refused_up_front(tmp_path, capsys):
    with pytest.raises(SystemExit):
        quality.main(["--preset", "h200-long", "--out", str(tmp_path / "q"), "--budget-s", "400"])
    err = capsys.readouterr().err
    assert "budget_s 400: after regen's end at 250s and 90s kept for τ, 60s are left for the drafters, less than " \
           "their start-up 80s" in err
    assert not (tmp_path / "q").exists()  # refused before anything ran


def test_the_main_run_s_steps_fit_its_deadline_at_the_pace_of_its_generation_and_objective(capsys, monkeypatch):
    """The schedule must decay inside the budget: a DFlash2 run sized at DFlash's pace was cut by the deadline at
    1,911 of 4,132 steps, its learning rate at 60 % of its peak (sixteenth session)."""
    monkeypatch.setattr(quality.time, "time", lambda: 1000.0)
    p = quality.Preset(drafter_rate=27.0, drafter_startup_s=45.0, drafter_steps=10**6)
    ap = quality.parser()
    deadline = 1000.0 + 245.0

    def steps(**overrides):
        return quality.main_steps(dataclasses.replace(p, main_overrides=overrides), deadline)

    base, dflash2, dflash2_kl = steps(), steps(drafter_kind="dflash2"), steps(drafter_kind="dflash2", objective="kl+dpace")
    assert base == 200 * 27
    assert steps(objective="ce+tv") == base and steps(drafter_kind="dflash") == base
    assert base * 0.5 < dflash2 < base * (200 - quality.DFLASH2_EXTRA_STARTUP_S) / 200 / quality.DFLASH2_STEP_COST + 1
    assert dflash2_kl == pytest.approx(dflash2 / quality.KL_STEP_COST, abs=2)
    assert f"{quality.DFLASH2_EXTRA_STARTUP_S + 45:.0f}s start-up" in capsys.readouterr().out

    # a budget that leaves DFlash time to start but not DFlash2 is refused up front, naming the start-up it needs
    argv = ["--out", "x", "--preset", "h200-recipe", "--budget-s", "420"]
    assert quality.preset_of(ap, ap.parse_args(argv)).budget_s == 420
    with pytest.raises(SystemExit):
        quality.preset_of(ap, ap.parse_args([*argv, "--set", "main_overrides={drafter_kind: dflash2}"]))
    assert f"less than their start-up {quality.DFLASH2_EXTRA_STARTUP_S + 45:g}s" in capsys.readouterr().err


def test_a_run_read_back_counts_its_steps_from_its_stop_not_its_last_logged_step(tmp_path):
    """Steps log every log_every steps: a run of 125 steps logged every 2 last logged step 124 (the H200
    objectives table counted such runs as stopped short and left them out of the table)."""
    from trainer.run.rundir import RunDir

    def logged(root: Path, stopped: bool) -> Path:
        rd = RunDir(root, total_steps=125)
        for step in range(2, 125, 2):
            rd.event("step", step, loss=1.0, acc=0.5, tokens_per_s=10.0)
        if stopped:
            rd.event("stop", 125, reason="done")
        return root

    run = quality.read_run(logged(tmp_path / "done", stopped=True))
    assert (run["steps"], run["stop"], run["train_loss"]) == (125, "done", 1.0)
    assert quality.read_run(logged(tmp_path / "killed", stopped=False))["steps"] == 124  # before its stop: what it logged


def test_the_command_line_edits_the_preset_and_refuses_an_unknown_field_or_ablation(capsys):
    ap = quality.parser()
    p = quality.preset_of(ap, ap.parse_args(["--out", "x", "--set", "target_steps=800", "--set", "prefix_chars=[5, 9]",
                                             "--ablations", "depth 1, gamma 20", "--budget-s", "0"]))
    assert (p.target_steps, p.prefix_chars, list(p.ablations), p.budget_s) == (800, (5, 9), ["depth 1", "gamma 20"], 0)
    assert quality.PRESETS["h200"].target_steps == 640  # the preset itself is left as it was
    assert quality.preset_of(ap, ap.parse_args(["--out", "x", "--no-ablations"])).ablations == {}
    for argv, message in ((["--set", "nope=1"], "--set nope=1: no preset field 'nope'"),
                          (["--ablations", "depth 9"], "--ablations: unknown ['depth 9']")):
        with pytest.raises(SystemExit):
            quality.preset_of(ap, ap.parse_args(["--out", "x", *argv]))
        assert message in capsys.readouterr().err


def test_a_run_takes_its_checkpoint_s_tau_only_where_its_own_cannot_stand(tmp_path):
    point = {"tau": 4.0, "tau_per_prompt": 3.9, "histogram": [1], "samples": 8, "checkpoint": "ck", "tau_lookup": 2.0,
             "tau_ratio": 2.0, "tau_by_length": {}, "step": 40}
    bf16 = {"name": "depth 1", "cfg": {"model": {"target": {"path": "m"}}}}
    fp8 = {"name": "fp8 target", "cfg": {"model": {"target": {"path": "m", "precision": "fp8"}}}}
    row = {"tau": 3.0}
    assert not quality.settle_tau(row, bf16, point, [], False) and row == {"tau": 3.0}  # its own τ stands
    assert quality.settle_tau(row, bf16, point, [bf16], False) and row["tau"] == 4.0  # compared: one evaluator
    row = {"tau": 3.0}
    assert quality.settle_tau(row, fp8, point, [], False)  # its own τ was against the FP8 target
    assert (row["tau"], row["tau_fp8_target"], row["tau_from"]) == (4.0, 3.0, "ck")
    row = {"tau": None}
    assert not quality.settle_tau(row, bf16, None, [], True) and row == {"tau": None}  # no checkpoint evaluated
def test_prompts_of_another_style_take_each_form_from_a_file():
    text = ('import os\n\n\ndef scale(values, factor=2):\n    """Each value times factor."""\n'
            '    out = []\n    for v in values:\n        out.append(v * factor)\n    return out\n\n\n'
            'def total(values):\n    return sum(values)\n')
    rng = random.Random(0)
    user, answer = quality.other_style(text, "signature", rng, 200)
    assert user == 'Implement this function:\n\ndef scale(values, factor=2):\n    """Each value times factor."""\n'
    assert answer.startswith("    out = []\n")
    user, _ = quality.other_style(text, "question", rng, 200)
    assert user.startswith("What does this code do") and user.split("\n\n", 1)[1] in text
    user, gap = quality.other_style(text, "middle", rng, 200)
    before, after = user.split("\n\n", 1)[1].split("<GAP>\n")
    assert before + gap + after in text and gap
    assert quality.other_style("x = 1\n", "middle", rng, 200) is None  # too short a file gives none


def test_the_other_style_prompts_get_their_own_temperature_table():
    by_t = {"0": {"tau": 2.0, "tau_expected": 2.0, "tau_lookup": 1.6, "tau_lookup_expected": 1.6},
            "1": {"tau": 1.5, "tau_expected": 1.52, "tau_lookup": 1.2, "tau_lookup_expected": 1.25, "tau_ceiling": 1.8}}
    rows = quality.other_temperature_rows({"heldout": {"tau": 3.0}, "other": {"tau": 2.0, "tau_by_temperature": by_t}})
    assert rows[1] == "other-style prompts (data/other.jsonl) by temperature:"
    assert "| 0 | 2.000 | 2.000 | 1.600 | 1.600 | 1.25 | - | - |" in rows
    assert "| 1 | 1.500 | 1.520 | 1.200 | 1.250 | 1.25 | 1.800 | 1.50 |" in rows  # the ceiling over lookup's
    assert quality.other_temperature_rows({"other": {"tau": 2.0, "tau_by_temperature": None}}) == []
    assert quality.other_temperature_rows(None) == []


def test_a_short_trainer_eval_leaves_the_tau_to_the_bench_s_own_evaluation(tmp_path, capsys):
    p = quality.PRESETS["h200-recipe"]
    assert p.short_trainer_eval and p.tau_from_checkpoints  # every τ it reports is the bench's, of the last checkpoint
    args = (tmp_path / "model", tmp_path / "t.jsonl", tmp_path, 100, {}, 50)
    short = quality.trainer_config(p, *args)["eval"]
    full = quality.trainer_config(dataclasses.replace(p, short_trainer_eval=False), *args)["eval"]
    assert full["temperatures"] == [0.0, 1.0] and full["max_new_tokens"] == p.eval_new_tokens == 256
    assert short["temperatures"] == [0.0] and short["max_new_tokens"] == 64
    assert {k: v for k, v in short.items() if k not in ("temperatures", "max_new_tokens")} == \
        {k: v for k, v in full.items() if k not in ("temperatures", "max_new_tokens")}
    ap = quality.parser()
    with pytest.raises(SystemExit):  # the trainer's check would be the run's τ
        quality.preset_of(ap, ap.parse_args(["--out", "x", "--set", "short_trainer_eval=true"]))
    assert "short_trainer_eval: only where the bench measures every last checkpoint" in capsys.readouterr().err


def test_the_goal_line_names_each_set_and_temperature_short_of_issue_50_s_ratio():
    def by_t(*ratios):
        return {"tau_by_temperature": {label: {"tau_ratio": r} for label, r in zip(("0", "1"), ratios)}}

    assert quality.goal_text({"heldout": by_t(2.1, 2.0), "other": by_t(1.6, 1.7)}) == "meets it in every cell"
    assert quality.goal_text({"heldout": by_t(1.52, 1.7), "other": by_t(0.99, 1.63)}) == (
        "short at heldout T=0 1.52x (goal 2x); heldout T=1 1.70x (goal 2x); other T=0 0.99x (goal 1.6x)")
    assert quality.goal_text({"heldout": {"tau": 3.0}}) is None and quality.goal_text(None) is None
