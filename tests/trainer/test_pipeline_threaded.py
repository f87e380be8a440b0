"""The threaded pipeline on CPU: same numbers as the reference loop, prompt failure, clean stop."""
import json
import threading

import pytest

from tests.trainer.tiny_config import tiny_config
from trainer.entry import train
from trainer.run.config import parse_config

OVERLAY = """
model: {target: {tiny: {layers: 4}}}
data:
  synthetic: {n_train: 200, n_eval: 4}
  num_anchors: 8
  token_budget: 256
optim: {total_steps: 4, micro_batches: 3}
devices: {target: [%(targets)s], drafter: [%(drafters)s]}
eval: {samples: 2}
pipeline: {kind: %(kind)s, pad_to_warm_shapes: %(pad)s}
"""


def config(kind="threaded", targets="cpu, cpu", drafters="cpu, cpu", pad="auto", extra=""):
    return parse_config(tiny_config(OVERLAY % dict(kind=kind, targets=targets, drafters=drafters, pad=pad), extra))


def events(run_dir, kind):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e["event"] == kind]


def status(run_dir):
    return json.loads((run_dir / "status.json").read_text())


@pytest.mark.slow
@pytest.mark.parametrize("pad", ["never", "always"])
def test_threaded_pipeline_matches_reference_loop(tmp_path, pad, fx_trace_threads):
    assert train(config(kind="reference", targets="cpu", drafters="cpu"), tmp_path / "ref") == 0
    assert train(config(pad=pad), tmp_path / "thr") == 0
    ref, thr = events(tmp_path / "ref", "step"), events(tmp_path / "thr", "step")
    assert [e["step"] for e in thr] == [e["step"] for e in ref] == [1, 2, 3, 4]
    for a, b in zip(ref, thr):
        for key in ("loss", "acc", "grad_norm", "lr"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (key, a["step"])
        assert b["recompiles"] == 0
        assert set(b["queues"]) >= {"prefetch->target0", "target1->drafter1"}
        assert {g["role"] for g in b["gpus"]} == {"cpu"}
    assert status(tmp_path / "thr")["state"] == "done"
    assert not [n for n in fx_trace_threads if n.startswith(("target", "drafter", "prefetch"))]


@pytest.mark.slow
def test_a_failing_stage_stops_every_thread_and_lands_in_status(tmp_path, monkeypatch):
    import trainer.pipeline.workers as workers

    calls = {"n": 0}
    real = workers.stage_context_features

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("target exploded on purpose")
        return real(*args, **kwargs)

    monkeypatch.setattr(workers, "stage_context_features", flaky)
    before = {t.name for t in threading.enumerate()}
    assert train(config(), tmp_path / "run") == 1
    st = status(tmp_path / "run")
    assert st["state"] == "failed"
    assert st["error"]["message"] == "RuntimeError: target exploded on purpose"
    assert st["error"]["thread"] in ("target0", "target1")
    assert "flaky" in st["error"]["traceback"]
    assert events(tmp_path / "run", "error")
    leftover = {t.name for t in threading.enumerate() if t.is_alive()} - before
    assert not leftover & {"prefetch", "target0", "target1", "drafter0", "drafter1"}


@pytest.mark.slow
def test_control_stop_before_the_first_step_stops_at_once_and_cleanly(tmp_path):
    """A stop already there when the run starts acts before any step (docs/run-lifecycle.md: a stop
    acts in every phase): stopped at step 0, nothing trained so no checkpoint, the request consumed.
    A stop while training checkpoints first (test_control_checkpoint_and_stop_are_honoured)."""
    run = tmp_path / "run"
    (run / "control").mkdir(parents=True)
    (run / "control" / "stop").write_text(json.dumps({"id": "req-1", "time": 0}))
    assert train(config(), run) == 0
    st = status(run)
    assert st["state"] == "stopped" and st["step"] == 0
    assert not st.get("last_checkpoint") and not list(run.glob("checkpoints/step_*"))
    assert events(run, "step") == []
    assert events(run, "stop")[0]["reason"] == "control"
    assert not (run / "control" / "stop").exists()


def test_threaded_packed_pipeline_matches_reference_loop(tmp_path, fx_trace_threads):
    """Packed rows through both loops: the same numbers, one warm shape, status with pad share."""
    packed = "data: {pack_length: 128, pack_rows: 2}"
    assert train(config(kind="reference", targets="cpu", drafters="cpu", extra=packed), tmp_path / "ref") == 0
    assert train(config(extra=packed), tmp_path / "thr") == 0
    ref, thr = events(tmp_path / "ref", "step"), events(tmp_path / "thr", "step")
    assert [e["step"] for e in thr] == [e["step"] for e in ref] == [1, 2, 3, 4]
    for a, b in zip(ref, thr):
        for key in ("loss", "acc", "grad_norm", "lr", "pad_share"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (key, a["step"])
        assert b["recompiles"] == 0 and 0 <= b["pad_share"] < 0.2
    assert events(tmp_path / "thr", "warmup")[0]["shapes"] == [[2, 128]]
    st = status(tmp_path / "thr")
    assert st["state"] == "done" and st["tokens_per_s_steady"] > 0 and 0 <= st["pad_share"] < 0.2
    # steady: the windows between the first (filling) and the last (draining what the target computed ahead)
    middle = thr[1:-1]
    seconds = sum(e["tokens"] / e["tokens_per_s"] for e in middle)
    assert st["tokens_per_s_steady"] == pytest.approx(sum(e["tokens"] for e in middle) / seconds, rel=1e-9)
