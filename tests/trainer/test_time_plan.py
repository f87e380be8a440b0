"""The time plan (issue #53 item 1): tokens, rate, wall time and GPU-hours from a config, the rate from
the bench's measured figures scaled to the config's shape and layout (trainer.models.time_plan)."""

import dataclasses
from pathlib import Path

from trainer.__main__ import main
from trainer.models import time_plan
from trainer.run.config import parse_config

REPO = Path(__file__).resolve().parents[2]


def eight_b(devices: str = "{target: [cuda:0], drafter: [cuda:0]}", precision: str = "bf16"):
    import yaml

    doc = yaml.safe_load((REPO / "trainer" / "configs" / "gpu-8b-shape.yaml").read_text())
    doc["devices"] = yaml.safe_load(devices)
    cfg = parse_config(yaml.safe_dump(doc))
    t = dataclasses.replace(cfg.model.target, precision=precision)
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, target=t))


def test_the_reference_shape_on_one_gpu_plans_the_measured_rate():
    cfg = eight_b()
    plan = time_plan.build_time_plan(cfg, "h200")
    assert round(plan.tokens_per_s) == 15045  # bench/RESULTS.md, bf16, one H200
    assert plan.positions_per_step == cfg.optim.micro_batches * cfg.data.pack_length
    assert plan.tokens == round(cfg.optim.total_steps * plan.positions_per_step * (1 - 0.0065))
    assert plan.gpus == 1 and abs(plan.gpu_hours - plan.wall_seconds / 3600) < 1e-9


def test_more_gpus_train_faster_and_cost_what_they_hold():
    one = time_plan.build_time_plan(eight_b(), "h200")
    split = time_plan.build_time_plan(eight_b("{target: [cuda:0], drafter: [cuda:1]}"), "h200")
    four = time_plan.build_time_plan(eight_b("{target: [cuda:0, cuda:1], drafter: [cuda:2, cuda:3]}"), "h200")
    assert one.tokens_per_s < split.tokens_per_s < four.tokens_per_s
    assert split.gpus == 2 and four.gpus == 4
    # two GPUs, one role each: the drafter (22,629 tok/s alone) is the bound
    assert 22629 <= split.tokens_per_s <= 22629 * 1.05
    assert abs(four.tokens_per_s - 2 * split.tokens_per_s) < 1
    fp8 = time_plan.build_time_plan(eight_b(precision="fp8"), "h200")
    assert round(fp8.tokens_per_s) == 16962


def test_the_8b_config_of_a_fresh_clone_prints_wall_time_and_gpu_hours(capsys):
    """No model directory and no data here: the time plan still sizes the run (the reference 8B shape)."""
    main(["plan", "--config", str(REPO / "trainer" / "configs" / "qwen3-8b.yaml"), "--gpu", "h200"])
    out = capsys.readouterr().out
    assert "tokens: 325,550,080 real (20,000 steps x 16,384 positions a step, less padding)" in out
    assert "rate: 15,045 real tokens/s on 1 x H200" in out
    assert "wall time: 6h02m" in out and "GPU-hours: 6.0" in out
    assert "target not sized" in out


def test_the_cpu_has_no_figure_and_calibration_measures_one(tmp_path, capsys):
    from tests.trainer.tiny_config import tiny_config

    config = tmp_path / "c.yaml"
    config.write_text(tiny_config("optim: {total_steps: 100000}"))
    assert main(["plan", "--config", str(config)]) == 0
    assert "time and cost: no throughput figure for the CPU: measure it with --calibrate N" in capsys.readouterr().out
    assert main(["plan", "--config", str(config), "--calibrate", "4"]) == 0
    out = capsys.readouterr().out
    assert "measured: 4 steps of this config on this host (--calibrate)" in out
    rate = float(out.split("rate: ")[1].split(" real")[0].replace(",", ""))
    assert rate > 0


def test_plan_data_counts_the_training_tokens_and_the_epochs_the_run_covers(tmp_path, capsys):
    import json

    import yaml

    from tests.trainer.tiny_config import tiny_config

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                                     {"role": "assistant", "content": "an answer " * 5}]}) + "\n"
                            for i in range(20)))
    doc = yaml.safe_load(tiny_config("optim: {total_steps: 100}\ndevices: {target: [cuda:0], drafter: [cuda:0]}"))
    doc["data"].pop("synthetic")
    doc["data"]["train_path"] = str(data)
    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump(doc))
    main(["plan", "--config", str(config), "--data", "--gpu", "h200"])
    out = capsys.readouterr().out
    cfg = parse_config(config.read_text())
    from trainer.data.report import build_report
    from trainer.data.tokenizer import build_tokenizer

    train = next(r for r in build_report(cfg, build_tokenizer(cfg)) if r.name == "train")
    planned = time_plan.build_time_plan(cfg, "h200").tokens
    assert f"data: {train.kept_tokens:,} tokens in 20 conversations: the run covers {planned / train.kept_tokens:.2f} epochs" in out
