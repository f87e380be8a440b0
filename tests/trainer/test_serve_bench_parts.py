"""trainer_tools.serve_bench's pieces that need no engine: prompt sets, argv templates, the metric."""

import json

from trainer_tools.serve_bench import DRAFTS, ENGINES, fill, read_set


def test_prompt_sets_in_the_shapes_users_have(tmp_path):
    f = tmp_path / "sets.jsonl"
    rows = [{"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
            {"prompt": "p"}, {"question": "q", "answer": "42"}, {"turns": ["t1", "t2"]}, {"problem": "m"},
            {"text": "mbpp"}]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert read_set(f) == [[{"role": "user", "content": c}] for c in ("a", "p", "q", "t1", "m", "mbpp")]


def test_vllm_argv_carries_the_speculative_config_as_json():
    argv = fill(ENGINES["vllm"]["dflash"], model="/m", draft="/d", port=8000, k=15)
    assert argv[:3] == ["vllm", "serve", "/m"] and "8000" in argv
    assert json.loads(argv[-1]) == {"method": "dflash", "model": "/d", "num_speculative_tokens": 15}
    ngram = json.loads(fill(ENGINES["vllm"]["ngram"], model="/m", draft="/d", port=1, k=7)[-1])
    assert ngram == {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def test_the_draft_round_counter_is_read_from_prometheus_text():
    text = ('# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.\n'
            'vllm:spec_decode_num_drafts_total{engine="0",model_name="target"} 154.0\n'
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="target"} 462.0\n')
    assert [float(v) for v in DRAFTS.findall(text)] == [154.0]
