"""bench/pipeline.py on CPU: multi-row, mixed-length batches through every stage, bucketed and packed."""
import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "pipeline.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_pipeline", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_every_stage_runs_on_multi_row_mixed_length_batches(tmp_path, capsys):
    bench = load_bench()
    results = bench.main([
        "--tiny", "--target", "cpu", "--drafter", "cpu", "--steps", "2", "--micro", "2", "--log-every", "1",
        "--mix", "lognormal", "--min-len", "16", "--max-len", "128", "--median", "40", "--samples", "120",
        "--bucket-edges", "32", "64", "128", "--token-budget", "256", "--anchors", "16",
        "--modes", "bucketed", "packed", "--pack-length", "256", "--pack-rows", "2",
        "--stage-micro", "4", "--naive-steps", "1", "--out", str(tmp_path / "bench.json")])
    bucketed, packed = results["bucketed"], results["packed"]
    assert any(rows > 1 for rows, _ in bucketed["warm_shapes"])  # several rows of mixed lengths per batch
    assert len({length for _, length in bucketed["warm_shapes"]}) > 1
    assert packed["warm_shapes"] == [[2, 256]] or packed["warm_shapes"] == [(2, 256)]
    for mode in (bucketed, packed):
        assert mode["target_alone"]["tokens_per_s"] > 0 and mode["drafter_alone"]["tokens_per_s"] > 0
        assert mode["naive_tokens_per_s"] > 0
        assert mode["pipeline"]["recompiles_after_warmup"] == 0 and mode["recompiles_after_stages"] == 0
        assert mode["pipeline"]["steps"] == 2
    assert packed["pipeline"]["pad_share"] < bucketed["pipeline"]["pad_share"]
    assert (tmp_path / "bench.json").exists()
    assert "packed" in capsys.readouterr().out.splitlines()[-1]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_issue_29_modes_and_the_trainer_cli_in_a_fresh_process(tmp_path, capsys):
    """packed (the previous drafter path) vs all (fused drafter, a background checkpoint halfway),
    then `python -m trainer` on the same conversations in a fresh process, in one run."""
    bench = load_bench()
    results = bench.main([
        "--tiny", "--target", "cpu", "--drafter", "cpu", "--steps", "4", "--micro", "2", "--log-every", "1",
        "--mix", "lognormal", "--min-len", "16", "--max-len", "128", "--median", "40", "--samples", "120",
        "--anchors", "16", "--modes", "packed", "all", "--pack-length", "256", "--pack-rows", "2",
        "--stage-micro", "2", "--cli-steps", "4", "--out", str(tmp_path / "bench.json")])
    assert [c["step"] for c in results["all"]["checkpoints"]] == [2] and "checkpoints" not in results["packed"]
    assert results["all"]["checkpoints"][0]["stall_s"] >= 0 and results["all"]["checkpoints"][0]["seconds"] > 0
    for mode in ("packed", "all"):
        assert results[mode]["pipeline"]["recompiles_after_warmup"] == 0 and results[mode]["pipeline"]["steps"] == 4
    cli = results["cli"]
    assert cli["exit"] == 0 and cli["state"] == "done" and cli["steps"] == 4, cli.get("log_tail")
    assert cli["tokens_per_s_steady"] > 0 and cli["recompiles"] == 0 and cli["compile_target"] is False  # CPU
    assert [c["step"] for c in cli["checkpoints"]] == [2, 4] and cli["bench_mode"] == "all"
    out = capsys.readouterr().out
    assert "trainer CLI, fresh process" in out and "all: checkpoint at step 2" in out


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_target_variants_truncated_untruncated_and_split_train_the_same(tmp_path):
    """#24's variants on the same data and target: the features are the same, so are the losses."""
    bench = load_bench()
    results = bench.main([
        "--tiny", "--target", "cpu", "--drafter", "cpu", "--steps", "2", "--micro", "2", "--log-every", "1",
        "--min-len", "16", "--max-len", "64", "--samples", "60", "--anchors", "8", "--stage-micro", "2",
        "--modes", "packed", "--pack-length", "128", "--variants", "whole", "untruncated", "split3"])
    losses = {key: results[key]["pipeline"]["loss"] for key in ("packed", "packed:untruncated", "packed:split3")}
    assert losses["packed"] == losses["packed:untruncated"] == losses["packed:split3"], losses
    assert all(results[key]["pipeline"]["recompiles_after_warmup"] == 0 for key in losses)
    assert "cpu:target0.2" in results["packed:split3"]["memory_plan"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_issue_42_fp8_moe_experts_and_the_70b_shape_truncated(tmp_path, capsys):
    """bf16 then the same target in FP8 (quantized in place), a MoE target with grouped expert matmuls and
    with the per-expert loop, and the 70B shape (tiny) built truncated at its last tap, layer by layer."""
    bench = load_bench()
    results = bench.main([
        "--tiny", "--target", "cpu", "--drafter", "cpu", "--steps", "2", "--micro", "1", "--log-every", "1",
        "--mix", "lognormal", "--min-len", "16", "--max-len", "128", "--median", "40", "--samples", "40",
        "--anchors", "16", "--modes", "packed", "--pack-length", "256", "--stage-micro", "1",
        "--targets", "8b", "30b-a3b", "70b", "--precisions", "bf16", "fp8", "--experts", "grouped_mm", "eager",
        "--modes-for", "8b=packed", "--steps-for", "8b=1", "--precisions-for", "8b=fp8",
        "--drafter-layers", "auto", "--out", str(tmp_path / "bench.json")])
    assert results["8b/packed@fp8"]["pipeline"]["steps"] == 1 and "8b/packed@bf16" not in results
    assert results["8b/quantized"]["linears"] == 6 * 7
    for key in ("30b-a3b/packed@bf16~grouped_mm", "30b-a3b/packed@bf16~eager", "30b-a3b/packed@fp8~grouped_mm",
                "70b/packed@bf16", "70b/packed@fp8"):
        assert results[key]["pipeline"]["steps"] == 2, results[key].get("error")
        assert results[key]["target_alone"]["tokens_per_s"] > 0
    assert results["30b-a3b/packed@bf16~eager"]["experts"] == "eager"
    assert results["30b-a3b/packed@fp8~grouped_mm"]["experts"] == "grouped_mm"
    assert results["70b/packed@fp8"]["precision"] == "fp8" and "70b/quantized" in results
    assert "linear layers in FP8" in results["30b-a3b/quantized"]["summary"]
    assert results["70b/target"]["layers_run"] == 6 and results["70b/drafter_plan@fp8"]["chosen"] == 5  # no budget
    # the memory plan sized from the target's own config, not the 8B the bench config names
    plan = results["70b/packed@fp8"]["memory_plan"]
    assert all(e["plan_gb"] < 1 for e in plan.values())
    assert "an fp8 target's 't MFU' halved is its share of the FP8 peak" in capsys.readouterr().out


def test_the_cli_run_takes_the_precision_the_drafter_and_the_70b_drafter_a_mask_row_of_its_vocabulary():
    from types import SimpleNamespace

    from transformers import LlamaConfig, Qwen3Config

    bench = load_bench()
    args = bench.argparse.Namespace(max_len=3072, pack_length=[8192], pack_rows=1, anchors=512, micro=2,
                                    log_every=3, target=["cuda:0"], drafter=["cuda:0"], tiny=False,
                                    cli_precision="fp8", cli_layout="full", sliding_window=2048)
    cfg = bench.cli_config(args, "/tmp/train.jsonl", 24)
    assert cfg["model"]["target"] == {"random_8b_shape": True, "precision": "fp8"}
    assert "drafter" not in cfg["model"] and cfg["model"]["drafter_layers"] == 5
    args.cli_layout = "swa4+1/dflash2/fp8"
    drafter = bench.cli_config(args, "/tmp/train.jsonl", 24)["model"]["drafter"]
    assert drafter["precision"] == "fp8" and drafter["kind"] == "dflash2" and len(drafter["layer_types"]) == 5
    assert bench.mask_id(args, LlamaConfig(**bench.LLAMA_3_3_70B_DIMS)) == 128255
    assert bench.mask_id(args, Qwen3Config(vocab_size=151936)) == 151669
    assert bench.mask_id(SimpleNamespace(tiny=True), None) == 5


def test_the_cli_run_is_compared_with_the_bench_row_of_its_precision_and_layout():
    """The H100 call of 2026-12-06 printed `None x the bench's None` for an fp8fast FP8-drafter CLI run: its
    row is keyed all@fp8fast@full/fp8, the lookup asked for @fp8 only."""
    bench = load_bench()
    row = {"pipeline": {"tokens_per_s_steady": 1.0}}
    results = {"all@fp8fast@full": row, "all@fp8fast@full/fp8": row, "all@fp8fast@full/dflash2": row}
    args = bench.argparse.Namespace(cli_precision="fp8fast", cli_layout="full/fp8")
    assert bench.bench_row_of_cli(args, results) == "all@fp8fast@full/fp8"
    args.cli_layout = "full"
    assert bench.bench_row_of_cli(args, results) == "all@fp8fast@full"
    assert bench.bench_row_of_cli(args, {"all@fp8": row}) == "all@fp8"  # one layout: no @layout in its key
    args.cli_precision = "bf16"
    assert bench.bench_row_of_cli(args, results) is None and bench.bench_row_of_cli(args, {"all": row}) == "all"


def test_the_70b_runs_at_the_precisions_given_for_it_and_only_bf16_is_refused():
    """--precisions-for 70b=fp8fast is what the 70B runs at, whatever --precisions says (its bf16 refusal
    once read the global list and dropped the shape's own)."""
    bench = load_bench()
    args = bench.argparse.Namespace(tiny=False, precisions_of={"70b": ["fp8fast"]})
    assert bench.precisions_of_shape(args, "70b", ["bf16"]) == (["fp8fast"], None)
    args.precisions_of = {}
    chosen, refusal = bench.precisions_of_shape(args, "70b", ["bf16", "fp8"])
    assert chosen == ["fp8"] and "70b in bf16" in refusal
    assert bench.precisions_of_shape(args, "30b-a3b", ["bf16"]) == (["bf16"], None)
    args.tiny = True  # the tiny 70B shape fits anywhere
    assert bench.precisions_of_shape(args, "70b", ["bf16"]) == (["bf16"], None)


def test_shape_options_name_the_bad_item(capsys):
    bench = load_bench()
    for argv, message in ((["--modes-for", "8b=fast"], "--modes-for 8b=fast"),
                          (["--steps-for", "70b=3"], "--steps-for 70b=3: SHAPE (one of --targets)"),
                          (["--precisions-for", "8b=fp4"], "--precisions-for 8b=fp4")):
        with pytest.raises(SystemExit):
            bench.main(["--tiny", "--target", "cpu", "--drafter", "cpu", "--samples", "4", *argv])
        assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_rows_of_several_lengths_with_the_drafter_checkpointed_and_not_in_one_run(tmp_path, capsys):
    """#35's measurement, tiny: each row length with model.checkpoint_drafter off, on and auto, steps
    from --tokens-per-mode; the one the memory plan says does not fit (512 not checkpointed, under a
    budget of 10.5 MiB) is skipped and said so, so is auto where it is what off measured (256);
    at 512 auto checkpoints the fewest layers that fit (1 of 2); checkpointing trains the same losses."""
    bench = load_bench()
    results = bench.main([
        "--tiny", "--target", "cpu", "--drafter", "cpu", "--micro", "1", "--min-len", "16", "--max-len", "128",
        "--samples", "120", "--anchors", "16", "--modes", "packed", "--pack-length", "256", "512",
        "--checkpoint-drafter", "off", "on", "auto", "--tokens-per-mode", "1024", "--stage-micro", "2",
        "--memory-gib", str(10.5 / 1024), "--out", str(tmp_path / "bench.json")])
    measured = {"packed_256:ckpt-off": 0, "packed_256:ckpt-on": 2, "packed_512:ckpt-on": 2, "packed_512:ckpt-auto": 1}
    assert "the memory plan does not fit: cpu:drafter0 needs" in results["packed_512:ckpt-off"]["skipped"]
    assert results["packed_256:ckpt-auto"]["skipped"] == "the same as packed_256:ckpt-off (0 drafter layers checkpointed)"
    for key, layers in measured.items():
        r = results[key]
        assert r["pipeline"]["recompiles_after_warmup"] == 0 and r["checkpoint_drafter"] == layers
        assert r["pipeline"]["steps"] == r["steps_planned"] == (4 if "256" in key else 3)  # ~1024 tokens each
    assert results["packed_256:ckpt-off"]["pipeline"]["loss"] == results["packed_256:ckpt-on"]["pipeline"]["loss"]
    summary = results["summary"]
    assert set(summary) == set(measured) and summary["packed_256:ckpt-off"]["x_shortest"] == 1.0
    assert summary["packed_512:ckpt-on"]["shortest"] == 256
    out = capsys.readouterr().out
    assert "packed_512:ckpt-off: skipped: the memory plan does not fit" in out
    assert "packed_512:ckpt-on: rows of 512, drafter layers checkpointed: 2:" in out


def test_a_measurement_s_key_names_only_what_varies_in_the_run():
    bench = load_bench()
    args = bench.parser().parse_args(["--tiny", "--one-rank"])
    args.precisions_of = {}
    assert bench.runs_of(args, "8b", {}) == [("bucketed", 0), ("bucketed/rank", 0)]
    args.modes, args.one_rank = ["all", "packed"], False
    assert bench.runs_of(args, "8b", {}) == [("packed", 8192), ("all", 8192)]  # in MODES' order
    assert bench.runs_of(args, "70b", {"70b": ["all", "packed"]}) == [("all", 8192), ("packed", 8192)]  # as given
    key = bench.measurement_key
    assert key(args, "packed", 8192, "bf16", ["bf16"], None, 5, [5]) == "packed"
    assert key(args, "packed", 8192, "fp8", ["bf16", "fp8"], None, 5, [5]) == "packed@fp8"
    assert key(args, "packed", 8192, "bf16", ["bf16", "fp8"], None, 3, [5, 3]) == "packed@bf16#d3"
    args.pack_length, args.experts = [8192, 16384], ["grouped_mm", "eager"]
    assert key(args, "all", 16384, "bf16", ["bf16"], "eager", 5, [5]) == "all_16384~eager"
    assert key(args, "bucketed", 0, "bf16", ["bf16"], None, 5, [5]) == "bucketed"  # no row length of its own


def test_the_summary_sets_each_measurement_against_the_bucketed_mode_and_the_shortest_rows():
    bench = load_bench()
    args = bench.parser().parse_args(["--tiny"])

    def measured(tokens_per_s, pack_length=None):
        stage = {"mfu_real": 0.5, "mfu_padded": 0.6}
        return {"pipeline": {"tokens_per_s_steady": tokens_per_s, "pad_share": 0.1, "recompiles_after_warmup": 0,
                             "host_syncs_per_step": 1.0, "mfu_steady": [{"target": 0.4, "drafter": 0.3}]},
                "warmup_s": 2.0, "warm_shapes": [(1, 64)], "peak_mem_gb_all": [3.0], "target_alone": stage,
                "drafter_alone": stage, "pipeline_over_bound": 0.9, "pack_length": pack_length,
                "checkpoint_drafter": "auto" if pack_length else None}

    results = {"lengths": {"n": 4}, "bucketed": measured(100.0), "all_8192": measured(150.0, 8192),
               "all_16384": measured(120.0, 16384), "all_32768": {"skipped": "the plan says it does not fit"}}
    summary = bench.summarise(args, results)
    assert list(summary) == ["bucketed", "all_8192", "all_16384"]  # measurements only
    assert [summary[k]["x_bucketed"] for k in summary] == [1.0, 1.5, 1.2]
    assert (summary["all_16384"]["shortest"], summary["all_16384"]["x_shortest"]) == (8192, 0.8)
    assert "x_shortest" not in summary["bucketed"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_issue_51_the_70b_shape_with_the_optimizer_state_on_the_host(tmp_path, capsys):
    """--offload host (optim.offload): the measurement trains through HostAdamW, reports the host's
    update per step and the plan's host entry beside the process's peak resident memory."""
    bench = load_bench()
    results = bench.main([
        "--tiny", "--target", "cpu", "--drafter", "cpu", "--steps", "2", "--micro", "2", "--log-every", "1",
        "--min-len", "16", "--max-len", "128", "--samples", "40", "--anchors", "16", "--modes", "packed",
        "--pack-length", "256", "--stage-micro", "1", "--targets", "70b", "--precisions", "fp8", "--offload", "host",
        "--drafter-layers", "auto", "--out", str(tmp_path / "bench.json")])
    run = results["packed@fp8"]
    assert run["offload"] == "host" and run["pipeline"]["steps"] == 2 and run["host_update_s_per_step"] > 0
    host = run["memory_plan"]["host"]
    assert host["items_gb"].keys() >= {"drafter master weights (fp32)", "AdamW states (fp32)"}
    assert host["process_peak_rss_gb"] > 0
    assert "optimizer (fp32)" not in run["memory_plan"]["cpu:drafter0"]["items_gb"]  # the states are on the host
    assert "packed@fp8: optim.offload host, 5 drafter layers" in capsys.readouterr().out
