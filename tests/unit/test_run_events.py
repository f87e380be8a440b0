"""metrics.jsonl lines and status.json documents are checked where they enter the operator's side."""

from __future__ import annotations

import json

from dflash_ops.helpers import nodefacts
from dflash_ops.runs.events import BadLine, parse_event
from dflash_ops.runs.info import RunInfo


def test_an_event_needs_its_documented_types_and_bounds():
    good = {"event": "step", "step": 3, "time": 1.0, "loss": None, "gpus": [{"index": 0, "role": "target", "busy": 0.5}]}
    assert parse_event(json.dumps(good).encode() + b"\n") == good
    cases = {
        '{"event": "step", "step": 3, "gpus": 5}': "gpus is int 5, not a list of {index: int, role, busy, mem_gb}",
        '{"event": "step", "step": true}': "step is a boolean, not an integer",
        '{"event": "eval", "tau": "high"}': "tau is str 'high', not a number or null",
        '{"step": 1}': "no 'event' field",
        "[1]": "a JSON list, not an object",
        "{": "not valid JSON (Expecting property name enclosed in double quotes)",
        "[" * 50_000 + "]" * 50_000: "nested deeper than 8 levels",
        '{"event": "x", "extra": ' + "[" * 20 + "]" * 20 + "}": "nested deeper than 8 levels",
        '{"event": "x", "pad": "' + "x" * (1 << 20) + '"}': "longer than 1048576 bytes",
    }
    for line, problem in cases.items():
        bad = parse_event(line)
        assert isinstance(bad, BadLine) and bad.problem == problem, (line[:40], bad)
        assert len(bad.text) <= 203


def test_helpers_read_json_files_within_bounds(tmp_path):
    deep = tmp_path / "status.json"
    deep.write_text('{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")
    assert nodefacts.read_json_checked(str(deep)) == (None, "status.json is not usable: nested deeper than 32 levels")


def test_status_fields_of_the_wrong_type_read_as_absent():
    info = RunInfo.from_json({"run_id": "r", "loss": "x", "step": 3, "gpus": [0, "a"], "alive": True})
    assert (info.loss, info.step, info.alive) == (None, 3, True)
