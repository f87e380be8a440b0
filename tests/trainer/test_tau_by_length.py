"""τ and the lookup baseline per prompt-length bucket (trainer.run.contract.PROMPT_LENGTH_BUCKETS):
in the evaluation, the run's eval event and status.json, and data-report's histogram per bucket."""

import json

from transformers import AutoTokenizer

from trainer.generate.evaluate import repeated_share, tau_by_form, tau_by_length, tau_by_repetition
from trainer.generate.speculative import Generation
from trainer.run.contract import length_bucket, tau_by_length_text


def test_buckets_bound_at_2k_8k_32k():
    assert [length_bucket(n) for n in (1, 2048, 2049, 8192, 8193, 32768, 32769, 10**6)] == \
        ["<=2K", "<=2K", "2-8K", "2-8K", "8-32K", "8-32K", ">32K", ">32K"]


def test_tau_per_bucket_pools_the_rounds_of_its_prompts_only_buckets_with_prompts():
    prompts = [[0] * 100, [0] * 3000, [0] * 5000, [0] * 40000]
    drafted = [Generation([], [4, 4]), Generation([], [2, 1]), Generation([], [3]), Generation([], [1, 1, 1])]
    looked = [Generation([], [2, 2]), Generation([], [1, 1]), Generation([], [1]), Generation([], [1])]
    got = tau_by_length(prompts, drafted, looked, block_size=8)
    assert list(got) == ["<=2K", "2-8K", ">32K"]  # no 8-32K prompt: no 8-32K entry
    assert {k: v for k, v in got["<=2K"].items() if "expected" not in k} == \
        {"prompts": 1, "prompt_tokens": 100, "tau": 4.0, "tau_lookup": 2.0, "tau_ratio": 2.0}
    assert got["2-8K"]["prompts"] == 2 and got["2-8K"]["tau"] == 2.0 and got["2-8K"]["tau_lookup"] == 1.0
    assert got[">32K"]["tau"] == 1.0
    assert tau_by_length(prompts, drafted, None, 8)["<=2K"]["tau_lookup"] is None
    assert tau_by_length_text(got) == ("<=2K 4.00 (lookup 2.00, 1 prompt); 2-8K 2.00 (lookup 1.00, 2 prompts); "
                                       ">32K 1.00 (lookup 1.00, 1 prompt)")
    assert tau_by_length_text({"<=2K": {"tau": "high"}, "x": 3}) == ""  # a reader's view: odd entries left out


def test_tau_per_form_pools_its_prompts_in_the_order_forms_first_appear():
    prompts = [[0] * 10] * 4
    drafted = [Generation([], [3, 5]), Generation([], [1]), Generation([], [2, 2]), Generation([], [6])]
    looked = [Generation([], [1, 1]), Generation([], [2]), Generation([], [2, 2]), Generation([], [1])]
    got = tau_by_form(["middle", "question", None, "middle"], prompts, drafted, looked, block_size=8)
    assert list(got) == ["middle", "question", "-"]
    assert got["middle"]["prompts"] == 2 and got["middle"]["tau"] == 14 / 3 and got["middle"]["tau_lookup"] == 1.0
    assert got["question"]["tau_ratio"] == 0.5 and got["-"]["tau"] == 2.0


def test_the_repeated_share_counts_answer_tokens_the_text_already_wrote_after_the_same_three():
    assert repeated_share([1, 2, 3, 4], [1, 2, 3, 4]) == 0.25  # 1 2 3 -> 4 written in the prompt: the 4 repeats
    assert repeated_share([], [5, 6, 7, 8, 5, 6, 7, 8, 5, 6]) == 0.3  # a loop: 8, 5, 6 after the first turn
    assert repeated_share([1, 2, 3, 9], [1, 2, 3, 4]) == 0.0  # the same three, another token after them
    assert repeated_share([1, 2], []) == 0.0
    # each position counts what any earlier occurrence was followed by, not only the first
    # (the answer's last 9 follows 1 2 3 as the prompt's first occurrence did, though its latest was followed by 4)
    assert repeated_share([1, 2, 3, 9, 1, 2, 3, 4], [1, 2, 3, 4, 1, 2, 3, 9]) == 5 / 8


def test_tau_per_repetition_bucket_pools_the_prompts_whose_answers_repeat_that_much():
    prompts = [[1, 2, 3, 4], [7, 7, 8], [1, 2, 3]]
    answers = [[1, 2, 3, 4] * 3, [9, 10, 11], [1, 2, 3, 1, 2, 3]]  # 9 of 12 repeat; none; 3 of 6
    drafted = [Generation(answers[0], [6, 6]), Generation(answers[1], [1, 1, 1]), Generation(answers[2], [2, 2, 2])]
    looked = [Generation(answers[0], [2, 2, 4, 4]), Generation(answers[1], [1, 1, 1]), Generation(answers[2], [1, 1, 4])]
    got = tau_by_repetition(prompts, drafted, looked, block_size=8)
    assert list(got) == ["under a third", "a third to two thirds", "two thirds or more"]
    assert [got[k]["prompts"] for k in got] == [1, 1, 1]
    assert got["under a third"]["tau"] == 1.0 and got["under a third"]["tau_ratio"] == 1.0
    assert got["a third to two thirds"]["tau"] == 2.0 and got["a third to two thirds"]["tau_lookup"] == 2.0
    assert got["two thirds or more"]["tau"] == 6.0 and got["two thirds or more"]["tau_lookup"] == 3.0
    assert "under a third" not in tau_by_repetition(prompts[:1], drafted[:1], None, 8)  # buckets with prompts only


def test_a_runs_evaluation_reports_tau_by_length_in_its_event_status_and_log(qwen3_model_dir, tmp_path):
    from trainer.entry import train
    from trainer.run.config import parse_config

    conv = [{"role": "user", "content": "What is 7 times 6?"}, {"role": "assistant", "content": "42."}]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": conv}) + "\n" for _ in range(4)))
    cfg = parse_config(f"model: {{target: {{path: {qwen3_model_dir}}}, drafter_layers: 1, block_size: 4, dtype: fp32}}\n"
                       f"data: {{train_path: {data}, max_length: 64, token_budget: 128, bucket_edges: [64],"
                       f" num_anchors: 2, pad_multiple: 16}}\n"
                       f"optim: {{total_steps: 1}}\nrun: {{threads: 1}}\neval: {{samples: 2, max_new_tokens: 3}}\n")
    assert train(cfg, tmp_path / "run") == 0
    events = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    (evaluation,) = [e for e in events if e["event"] == "eval"]
    by_length = evaluation["tau_by_length"]
    assert list(by_length) == ["<=2K"] and by_length["<=2K"]["prompts"] == 2
    assert by_length["<=2K"]["tau"] == evaluation["tau"] and by_length["<=2K"]["tau_lookup"] == evaluation["tau_lookup"]
    assert by_length["<=2K"]["prompt_tokens"] == evaluation["prompt_tokens"]
    status = json.loads((tmp_path / "run" / "status.json").read_text())
    assert status["tau_by_length"] == by_length
    assert "tau by prompt length: <=2K " in (tmp_path / "run" / "train.log").read_text()


def test_data_report_prints_each_length_bucket_and_what_it_cuts(qwen3_model_dir, tmp_path, capsys):
    from trainer.__main__ import main

    tok = AutoTokenizer.from_pretrained(qwen3_model_dir, local_files_only=True)
    words = {n: " ".join(["word"] * n) for n in (10, 1000)}
    rows = [{"prompt": "Q?", "response": words[10]}] * 3 + [{"prompt": "Q?", "response": words[1000]}]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    full = len(tok.apply_chat_template([{"role": "user", "content": "Q?"}, {"role": "assistant", "content": words[1000]}],
                                       tokenize=True, return_dict=False))
    assert 2048 < full <= 8192
    config = tmp_path / "c.yaml"
    config.write_text(f"model: {{target: {{path: {qwen3_model_dir}}}}}\n"
                      f"data: {{train_path: {data}, max_length: 2048, token_budget: 4096, bucket_edges: [2048]}}\n")
    assert main(["data-report", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "by length bucket (tokens per conversation" in out
    assert "  <=2K        3 conversations (75.0%); truncated 0 (0.0%), 0 of" in out
    assert f"  2-8K        1 conversations (25.0%); truncated 1 (100.0%), {full - 2048} of {full} tokens cut" in out
    assert "8-32K" not in out.split("by length bucket")[1]


def test_tau_by_temperature_in_status_text_events_and_trackers():
    from dflash_ops.runs.events import BadLine, parse_event
    from trainer.run.contract import tau_by_temperature, tau_by_temperature_text
    from trainer.train.trackers import scalars

    reports = {"0": {"tau": 3.0, "tau_expected": 3.0, "tau_lookup": 1.5, "tau_lookup_expected": 1.5, "rounds": 9},
               "0.7": {"tau": 2.5, "tau_expected": 2.4, "tau_lookup": 1.2, "tau_lookup_expected": None}}
    assert tau_by_temperature(reports)["0.7"] == {"tau": 2.5, "tau_expected": 2.4, "tau_lookup": 1.2,
                                                   "tau_lookup_expected": None}
    assert tau_by_temperature_text(reports) == ("T=0 3.00 (expected 3.00, lookup 1.50); "
                                                "T=0.7 2.50 (expected 2.40, lookup 1.20)")
    assert tau_by_temperature_text({"1": {"tau": None}, "x": 3}) == ""  # a reader's view: odd entries left out
    event = {"event": "eval", "time": 1.0, "step": 4, "tau": 3.0, "temperatures": reports}
    assert not isinstance(parse_event(json.dumps(event)), BadLine)
    assert isinstance(parse_event(json.dumps({**event, "temperatures": {"1": {"tau": "high"}}})), BadLine)
    assert scalars({"eval": event})["eval/temperatures/0.7/tau_expected"] == 2.4
