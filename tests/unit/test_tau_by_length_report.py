"""τ by prompt length as the operator sees it: `metrics` lines, `run status` (status.json's
tau_by_length through the contract's fields), and the events parser's check of its shape."""

import json

from dflash_ops.runs import RunInfo
from dflash_ops.runs.events import BadLine, parse_event
from dflash_ops.runs.report import metric_line, status_detail

BY_LENGTH = {"<=2K": {"prompts": 12, "prompt_tokens": 9000, "tau": 3.5, "tau_lookup": 1.75, "tau_ratio": 2.0},
             "8-32K": {"prompts": 2, "prompt_tokens": 30000, "tau": 1.25, "tau_lookup": None, "tau_ratio": None}}


def test_the_eval_line_and_run_status_show_tau_per_bucket():
    line = metric_line({"event": "eval", "step": 3, "tau": 3.0, "acc": 0.5, "samples": 14, "tau_by_length": BY_LENGTH})
    assert line.endswith("samples 14  by prompt length: <=2K 3.50 (lookup 1.75, 12 prompts); 8-32K 1.25 (2 prompts)")
    info = RunInfo.from_json({"run_id": "r", "effective_state": "running", "tau": 3.0, "tau_by_length": BY_LENGTH})
    assert info.tau_by_length == BY_LENGTH
    assert status_detail(info)[0] == "tau by prompt length: <=2K 3.50 (lookup 1.75, 12 prompts); 8-32K 1.25 (2 prompts)"
    assert not any("by prompt length" in x for x in status_detail(RunInfo.from_json({"run_id": "r", "tau": 3.0})))


def test_a_tau_by_length_of_another_shape_is_a_bad_line():
    good = {"event": "eval", "step": 3, "time": 1.0, "tau": 3.0, "tau_by_length": BY_LENGTH}
    assert parse_event(json.dumps(good)) == good
    for bad in ([1, 2], {"<=2K": {"prompts": "12", "tau": 3.0}}, {"<=2K": {"prompts": 1, "tau": None}}):
        assert isinstance(parse_event(json.dumps({**good, "tau_by_length": bad})), BadLine)
    odd = RunInfo.from_json({"run_id": "r", "tau_by_length": [1]})  # status.json's field of another type: absent
    assert odd.tau_by_length is None
