"""`python -m trainer eval`: τ of a checkpoint and of its export at each temperature, without training,
run as a user runs it (a fresh process from the repository root). The export and its evaluation run
the same command's main() in the test's process: a fresh process costs ~4 CPU-seconds of imports, and
what they add (the export drafts what the checkpoint drafts) does not depend on the process; the
checkpoint's evaluation is the fresh process (a real `python -m trainer export` is
tests/integration/test_real_path_playbook.py's)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import trainer
from tests.trainer.tiny_config import tiny_config

ROOT = Path(trainer.__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def run_cli(*args: str, without_torch: bool = False) -> subprocess.CompletedProcess:
    """`python -m trainer ARGS`; without_torch: where `import torch` fails (runpy runs the same
    trainer/__main__.py that -m runs)."""
    argv = (["-c", "import runpy, sys; sys.modules['torch'] = None; runpy.run_module('trainer', run_name='__main__')"]
            if without_torch else ["-m", "trainer"])
    return subprocess.run([sys.executable, *argv, *args], cwd=ROOT, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step tiny run's config and its final checkpoint."""
    from trainer.entry import train
    from trainer.run.config import parse_config

    root = tmp_path_factory.mktemp("eval")
    text = tiny_config("optim: {total_steps: 2}", "data: {synthetic: {n_eval: 3}}",
                       "eval: {samples: 3, max_new_tokens: 10, temperatures: [0, 1.0]}")
    config = root / "tiny.yaml"
    config.write_text(text)
    assert train(parse_config(text), root / "run") == 0
    (checkpoint,) = sorted((root / "run" / "checkpoints").glob("step_*"))
    return config, checkpoint, root


def test_eval_of_a_checkpoint_and_of_its_export(trained, capsys):
    from trainer.__main__ import main

    config, checkpoint, root = trained
    out = run_cli("eval", "--config", str(config), "--checkpoint", str(checkpoint), "--temperature", "0", "0.7",
                  "--json", str(root / "ck.json"))
    assert out.returncode == 0, out.stderr
    header, *rows = out.stdout.splitlines()
    assert header.split()[:4] == ["T", "tau", "tau_expected", "tau_per_prompt"] and "lookup" in header
    assert rows[0].split()[0] == "0" and rows[1].split()[0] == "0.7"
    report = json.loads((root / "ck.json").read_text())
    assert list(report["temperatures"]) == ["0", "0.7"] and report["samples"] == 3
    zero = report["temperatures"]["0"]
    assert zero["tau"] == zero["tau_expected"] == report["tau"] >= 1
    assert report["temperatures"]["0.7"]["temperature"] == 0.7 and report["temperatures"]["0.7"]["tau_lookup"] >= 1
    # at T = 0 (one answer a prompt for every decoding) τ by how much of the answer repeats its own text
    by_repetition = zero["tau_by_repetition"]
    assert sum(b["prompts"] for b in by_repetition.values()) == 3 and "tau_by_repetition" not in report["temperatures"]["0.7"]
    assert [line for line in rows if line.startswith("T=0 answers repeating")] == [
        f"T=0 answers repeating {part} of their text: tau {b['tau']:.3f}, expected {b['tau_expected']:.3f}, lookup "
        f"{b['tau_lookup']:.3f} ({b['prompts']} prompts)" for part, b in by_repetition.items()]
    # the run's own evaluation at T = 0 (its end) decoded the same prompts with the same weights
    run_eval = [json.loads(line) for line in (checkpoint.parents[1] / "metrics.jsonl").read_text().splitlines()
                if '"event": "eval"' in line][-1]
    assert run_eval["temperatures"]["0"]["tau"] == zero["tau"]

    exported = root / "export"
    capsys.readouterr()
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(exported)]) == 0
    assert capsys.readouterr().out == f"exported to {exported}\n"
    assert main(["eval", "--config", str(config), "--export", str(exported), "--samples", "3", "--ceiling",
                 "--json", str(root / "ex.json")]) == 0
    header = capsys.readouterr().out.splitlines()[0].split()
    assert header[:4] == ["T", "tau", "tau_expected", "tau_per_prompt"] and header[-3:] == [
        "ceiling", "ceiling_expected", "ceiling/lookup"]
    again = json.loads((root / "ex.json").read_text())
    assert list(again["temperatures"]) == ["0", "1"]  # the config's eval.temperatures
    assert again["temperatures"]["0"]["tau"] == zero["tau"]  # the export drafts what the checkpoint drafts
    # --ceiling: the target drafting for itself, every draft accepted at T = 0, above any drafter's τ
    assert zero["tau"] <= again["temperatures"]["0"]["tau_ceiling"] == again["temperatures"]["0"]["tau_ceiling_expected"]
    assert again["temperatures"]["1"]["tau_ceiling_expected"] < again["temperatures"]["0"]["tau_ceiling"]
    assert "tau_ceiling" not in zero  # only when asked

    # --draft-sample-method probabilistic: the draft's proposals sampled and verified with q at T > 0; T = 0 and
    # lookup (argmax proposals, no q) are what they were
    assert main(["eval", "--config", str(config), "--export", str(exported), "--samples", "3",
                 "--draft-sample-method", "probabilistic", "--json", str(root / "pr.json")]) == 0
    capsys.readouterr()
    sampled = json.loads((root / "pr.json").read_text())["temperatures"]
    assert sampled["0"]["tau"] == zero["tau"] and sampled["0"]["sampling"] == "T=0"
    assert sampled["1"]["sampling"] == "T=1 draft=probabilistic" and again["temperatures"]["1"]["sampling"] == "T=1"
    assert sampled["1"]["tau_lookup"] == again["temperatures"]["1"]["tau_lookup"]

    # --ceiling without a draft: lookup and the ceiling alone, at the config's block size, on the same prompts
    assert main(["eval", "--config", str(config), "--samples", "3", "--ceiling", "--json", str(root / "hr.json")]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[0].split() == ["T", "lookup", "lookup_expected", "ceiling", "ceiling_expected", "ceiling/lookup"]
    headroom = json.loads((root / "hr.json").read_text())
    by_position = headroom["temperatures"]["0"]["ceiling_acceptance_expected"]
    assert shown[3] == "T=0 ceiling accepted by position (expected): " + " ".join(f"{a:.2f}" for a in by_position)
    assert by_position == sorted(by_position, reverse=True) and len(by_position) == headroom["block_size"] - 1
    assert shown[-1].startswith("ceiling: the target's own greedy chain") and "argmax" in shown[-1]
    assert headroom["draft"] is None and list(headroom["temperatures"]) == ["0", "1"]
    for label, beside in again["temperatures"].items():
        alone = headroom["temperatures"][label]
        for key in ("tau_lookup", "tau_lookup_expected", "tau_ceiling", "tau_ceiling_expected", "ceiling_over_lookup"):
            assert alone[key] == beside[key], (label, key)
        assert "tau" not in alone


def test_eval_refuses_bad_input_in_one_line(trained, tmp_path):
    config, checkpoint, _ = trained
    # every one of these is refused before torch is imported (1.5 CPU-seconds a process)
    for args, says, early in [(["--checkpoint", str(tmp_path / "nothing")], "not a draft model directory", True),
                              (["--checkpoint", str(checkpoint), "--top-p", "0"], "top_p must be in (0, 1]", True),
                              (["--checkpoint", str(checkpoint), "--temperature", "-1"], "temperature must be", True),
                              (["--checkpoint", str(checkpoint), "--data", str(tmp_path / "none.jsonl")], "no such file",
                               True),
                              (["--checkpoint", str(checkpoint), "--json", str(tmp_path / "no" / "r.json")],
                               "does not exist", True)]:
        out = run_cli("eval", "--config", str(config), *args, without_torch=early)
        assert out.returncode == 2 and says in out.stderr and len(out.stderr.strip().splitlines()) == 1, (args, out)
    assert not (tmp_path / "no").exists()
    neither = run_cli("eval", "--config", str(config), without_torch=True)
    assert neither.returncode == 2 and "give the draft (--checkpoint or --export), or --ceiling alone" in neither.stderr


def test_eval_loads_the_layers_training_left_on_the_meta_device(qwen3_model_dir, tmp_path):
    """A target directory of 4 layers of which training reads 2 (the taps): the checkpoint's τ needs the
    layers above, its final norm and LM head, which training never loaded. On the GPU the quality bench's
    `python -m trainer eval` failed here ("Tensor on device cuda:0 is not on the expected device meta")."""
    from trainer.entry import train
    from trainer.run.config import parse_config
    from trainer.train.draft_eval import evaluate_draft

    text = (f"model: {{target: {{path: {qwen3_model_dir}}}, drafter_layers: 1, block_size: 4, num_target_layers: 1,"
            f" dtype: fp32}}\n"
            "data: {synthetic: {n_train: 16, n_eval: 2, seed: 0, min_len: 8, max_len: 30}, max_length: 64,"
            " num_anchors: 4, token_budget: 128, bucket_edges: [64]}\n"
            "optim: {total_steps: 1}\nrun: {threads: 1}\n"
            "eval: {samples: 2, max_new_tokens: 6, temperatures: [0, 1.0]}\n")
    cfg = parse_config(text)
    assert train(cfg, tmp_path / "run") == 0
    (checkpoint,) = sorted((tmp_path / "run" / "checkpoints").glob("step_*"))
    report = evaluate_draft(cfg, checkpoint, temperatures=[0.0, 0.7], log=lambda _: None)
    assert list(report["temperatures"]) == ["0", "0.7"] and report["samples"] == 2
    assert report["tau"] >= 1 and report["temperatures"]["0.7"]["tau"] >= 1
