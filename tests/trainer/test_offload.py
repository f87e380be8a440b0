"""optim.offload host (trainer.train.offload): the fp32 masters and AdamW states on the host.

On the CPU "host" and "device" are the same memory, but the same code runs: the gradients copied
into the transfer buffer chunk by chunk, widened, the fused CPU AdamW on each chunk's masters, the
weights narrowed and copied back.

Why a tolerance between runs with and without offload: the offloaded update is torch's fused CPU
AdamW kernel, the CPU run without offload takes AdamW's for-loop implementation; the two round the
update differently (about one ulp of a weight per step; measured: 4e-8 after 6 steps). Everything
else (gradients, their normalisation and clipping, the state dict) is the same computation, and the
update itself is bit-identical to the fused kernel stepping all parameters at once (the first test).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from tests.trainer.tiny_config import tiny_config
from trainer.run import checkpoint as ckpt
from trainer.run.config import ConfigError, OptimConfig, parse_config
from trainer.train.offload import HostAdamW, chunked, load_model_state, model_state

OPTIM = OptimConfig(lr=3e-3, weight_decay=0.1, betas=[0.9, 0.95])


def parameters(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(shape, generator=g)) for shape in [(7, 5), (40,), (3, 4, 5), (9,)]]


def test_chunks_hold_consecutive_parameters_up_to_the_limit_a_larger_one_alone():
    assert chunked([35, 40, 60, 9], 50) == [[0], [1], [2], [3]]
    assert chunked([10, 20, 15, 5, 100, 3], 50) == [[0, 1, 2, 3], [4], [5]]


def test_the_host_update_is_the_fused_adamw_update_chunk_by_chunk():
    """Masters stepped a chunk at a time (chunks of at most 50 elements here: four chunks, one parameter
    larger than a chunk), a parameter without a gradient skipped, the step's factor (grad_scale, as
    FlatGrads hands it) applied on the host: bit for bit torch's fused AdamW over all parameters at once."""
    device_params, reference = parameters(0), parameters(0)
    opt = HostAdamW(device_params, OPTIM, torch.float32, chunk_elements=50)
    assert len(opt.chunks) == 4
    ref = torch.optim.AdamW(reference, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True)
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        scale = torch.tensor(1.0 + step)
        for i, (p, q) in enumerate(zip(device_params, reference)):
            grad = None if (i == 3 and step < 2) else torch.randn(p.shape, generator=g)
            p.grad = None if grad is None else grad.clone()
            q.grad = None if grad is None else grad / scale
        opt.grad_scale = scale
        opt.step()
        ref.step()
        for p, master, q in zip(device_params, opt.masters, reference):
            assert torch.equal(master, q) and torch.equal(p.detach(), q.detach())
    assert opt.state[opt.masters[3]]["step"].item() == 3  # stepped only where it had a gradient
    assert opt.grad_scale is None  # a factor applies to its own step only


class RecordingStreams:
    """torch.cuda's stream calls HostAdamW makes, recorded on a CPU: which stream waited for which,
    and on which stream each event was recorded (the side stream's copies are what events mark)."""

    class Stream:
        def __init__(self, name: str, log: list) -> None:
            self.name, self.log = name, log

        def wait_stream(self, other: "RecordingStreams.Stream") -> None:
            self.log.append(f"{self.name} waits for {other.name}")

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        import contextlib

        self.log: list[str] = []
        self.current = [self.Stream("training", self.log)]
        log, current = self.log, self.current

        class Event:
            def record(self, stream: RecordingStreams.Stream) -> None:
                log.append(f"event on {stream.name}")

            def synchronize(self) -> None:
                pass

        @contextlib.contextmanager
        def stream(s: RecordingStreams.Stream):
            current.append(s)
            try:
                yield
            finally:
                current.pop()

        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[-1])
        monkeypatch.setattr(torch.cuda, "stream", stream)
        monkeypatch.setattr(torch.cuda, "Event", Event)


def test_the_gradient_copies_wait_for_the_training_stream_and_the_next_forward_for_the_uploads(monkeypatch):
    """On a GPU the step's copies run on a side stream: it must wait for the stream the backward ran
    on before its first copy (waiting inside the side stream for "the current stream" waited for
    itself: the copies raced the backward and the step factor, and the 8B run's loss went NaN), and
    the training stream must wait for the uploads before the next forward reads the weights."""
    cuda = RecordingStreams(monkeypatch)
    opt = HostAdamW(parameters(0), OPTIM, torch.float32, chunk_elements=50)
    opt.stream = cuda.Stream("side", cuda.log)  # type: ignore[assignment]
    for p in opt.device_params:
        p.grad = torch.ones_like(p)
    opt.grad_scale = torch.tensor(2.0)
    opt.step()
    assert cuda.log == ["side waits for training", *["event on side"] * len(opt.chunks), "training waits for side"]


def test_the_device_keeps_the_compute_dtype_and_a_checkpoint_the_fp32_masters():
    module = torch.nn.Linear(16, 8)
    fp32 = {k: v.clone() for k, v in module.state_dict().items()}
    opt = HostAdamW(module.parameters(), OPTIM, torch.bfloat16)
    assert module.weight.dtype == torch.bfloat16 and all(m.dtype == torch.float32 for m in opt.masters)
    assert all(torch.equal(model_state(module, opt)[k], v) for k, v in fp32.items())  # not rounded to bf16
    module(torch.randn(4, 16, dtype=torch.bfloat16)).sum().backward()
    opt.step()
    state = model_state(module, opt)
    assert state["weight"].dtype == torch.float32 and not torch.equal(state["weight"], fp32["weight"])
    assert torch.equal(module.weight.detach(), state["weight"].to(torch.bfloat16))  # the device: the masters, narrowed
    assert state["weight"].to(torch.bfloat16).float().ne(state["weight"]).any()  # the masters keep what bf16 drops
    opt.zero_grad()
    assert module.weight.grad is None

    other = torch.nn.Linear(16, 8)
    other_opt = HostAdamW(other.parameters(), OPTIM, torch.bfloat16)
    load_model_state(other, other_opt, state)
    assert all(torch.equal(a, b) for a, b in zip(other_opt.masters, opt.masters))
    assert torch.equal(other.weight, module.weight)


def test_gradients_below_fp32_keep_the_steps_sums_in_fp32():
    from trainer.distributed.grad_sync import FlatGrads, ReplicaAllReduce
    from trainer.run.stopping import StopSignal

    params = [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))]
    flat = FlatGrads(params)
    flat.add_stats(torch.tensor(1.0), torch.tensor(100001.0), torch.tensor(3.0))
    assert flat.stats.dtype == torch.float32 and flat.stats[1].item() == 100001.0  # bf16 would hold 99840
    with pytest.raises(ValueError, match="one replica on one host"):
        ReplicaAllReduce([flat], [None], StopSignal(), across_hosts=lambda t: None)


def run_config(offload: str, kind: str = "reference", steps: int = 6) -> str:
    return tiny_config(f"optim: {{total_steps: {steps}, offload: {offload}}}", "run: {checkpoint_every: 3}",
                       f"pipeline: {{kind: {kind}}}", "eval: {every: 0}")


def losses(run: Path) -> dict[int, float]:
    events = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    return {e["step"]: e["loss"] for e in events if e["event"] == "step"}


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)  # one ulp a step (the module doc)


@pytest.mark.parametrize("kind", ["reference", "threaded"])
def test_a_run_with_offload_trains_like_one_without(tmp_path, kind):
    from trainer.entry import train

    for offload in ("none", "host"):
        assert train(parse_config(run_config(offload, kind)), tmp_path / offload) == 0
    assert "optim.offload host: the drafter's fp32 weights and AdamW states in host memory" in \
        (tmp_path / "host" / "train.log").read_text()
    straight, offloaded = (ckpt.load(tmp_path / name / "checkpoints" / "step_6") for name in ("none", "host"))
    close(straight["model"], offloaded["model"])
    a, b = straight["optim"]["optimizer"], offloaded["optim"]["optimizer"]
    assert a["state"].keys() == b["state"].keys()  # the same format: AdamW's, per parameter index
    for i in a["state"]:
        close(a["state"][i], b["state"][i])
    for x, y in zip(losses(tmp_path / "none").values(), losses(tmp_path / "host").values()):
        assert abs(x - y) <= 1e-5


@pytest.mark.parametrize("first, then", [("none", "host"), ("host", "none")])
def test_a_run_resumes_across_the_offload_settings(tmp_path, first, then):
    """Checkpointed at step 3 with one setting, resumed with the other: steps 4..6 as the uninterrupted
    run's, within the kernels' rounding, which an optimizer state left behind would exceed by far
    (a fresh AdamW's first update moves every weight by about lr = 3e-3)."""
    from trainer.entry import train

    run = tmp_path / "run"
    assert train(parse_config(run_config(first)), run) == 0
    straight = ckpt.load(run / "checkpoints" / "step_6")
    before = losses(run)
    assert train(parse_config(run_config(then)), run, resume="3") == 0
    resumed = ckpt.load(run / "checkpoints" / "step_6")
    close(straight["model"], resumed["model"])
    for i in straight["optim"]["optimizer"]["state"]:
        close(straight["optim"]["optimizer"]["state"][i], resumed["optim"]["optimizer"]["state"][i])
    after = {e["step"]: e["loss"] for e in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
             if e["event"] == "step"}  # the resumed run's steps replace the first run's
    assert all(abs(after[s] - before[s]) <= 1e-5 for s in (4, 5, 6))


def test_offload_is_refused_for_more_than_one_drafter_replica():
    with pytest.raises(ConfigError, match="optim.offload host needs one drafter replica"):
        parse_config(tiny_config("optim: {offload: host}", "devices: {drafter: [cpu, cpu]}"))
    with pytest.raises(ConfigError, match="optim.offload must be one of"):
        parse_config(tiny_config("optim: {offload: states}"))


def test_host_state_is_written_in_place_and_the_next_update_waits_for_the_write(tmp_path):
    """stage_host off: the masters are not copied for the checkpoint; the optimizer's next step waits
    until the writer has written them, so the checkpoint holds this step's weights, not the next one's."""
    from trainer.train.checkpointer import Checkpointer

    module = torch.nn.Linear(4, 4)
    opt = HostAdamW(module.parameters(), OPTIM, torch.float32)
    release, written = threading.Event(), {}

    class SlowManager:
        def save(self, step, model, drafter_config, optim, trainer_state):
            release.wait()
            written.update({k: v.clone() for k, v in model.items()})
            return tmp_path, 0.0

    checkpointer = Checkpointer(SlowManager(), lambda *a: None, lambda *a: None, stage_host=False)
    state = model_state(module, opt)
    job = checkpointer.snapshot(1, state, {}, {"optimizer": opt.state_dict()}, {}, optimizers=(opt,))
    assert job.model["weight"].data_ptr() == state["weight"].data_ptr()  # not staged: written from where it lives
    assert checkpointer.staged_bytes() == 0
    before = state["weight"].clone()
    module(torch.randn(2, 4)).sum().backward()
    stepped = threading.Event()
    threading.Thread(target=lambda: (opt.step(), stepped.set()), daemon=True).start()
    assert not stepped.wait(0.2)  # the update waits for the write
    release.set()
    assert stepped.wait(30)
    checkpointer.close()
    assert torch.equal(written["weight"], before) and not torch.equal(opt.masters[0], before)


def test_the_plan_fits_a_5_layer_drafter_beside_the_70b_fp8_target_on_one_h200_with_offload(tmp_path, capsys):
    """Llama-3.3-70B's config.json alone; the bench's 70B shape (bench/pipeline.py --targets 70b: fp8,
    8192-token packed rows, 512 anchors of 16, no drafter checkpointing): without offload the 5-layer
    drafter needs 180.7 GiB of a 139 GiB H200; with the masters and AdamW states on the host it fits, the
    host holding 14 bytes a parameter (fp32 masters, two moments, the bf16 transfer buffer) and a chunk."""
    from transformers import LlamaConfig

    from trainer.__main__ import main
    from trainer.models.memory_plan import GIB, build_plan

    LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False).save_pretrained(tmp_path)
    config = """
model: {target: {tiny: null, path: %s, precision: fp8}, mask_token_id: 128255, drafter_layers: 5, dtype: bf16,
        block_size: 16, num_target_layers: 5, checkpoint_drafter: false, fuse_drafter: true}
data: {synthetic: null, train_path: x.jsonl, max_length: 3072, num_anchors: 512, token_budget: 3072,
       bucket_edges: [3072], pack_length: 8192, pad_multiple: 64}
optim: {micro_batches: 2, offload: %s}
devices: {target: [cuda:0], drafter: [cuda:0]}
pipeline: {kind: threaded}
"""
    h200 = {0: 139 * GIB}

    def plan(offload, host_gib=128):
        return build_plan(parse_config(tiny_config(config % (tmp_path, offload))), gpu_bytes=h200,
                          host_bytes=host_gib * GIB)

    without, offloaded = plan("none"), plan("host")
    assert not without.fits and without.refusal().startswith("cuda:0 needs 180.71 GiB")
    assert offloaded.fits, offloaded.refusal()
    params = without.drafter["weights (fp32)"] // 4
    device = {d.device: d for d in offloaded.devices}
    assert offloaded.offloaded == 12 * params  # 16 bytes a parameter on the device become 4
    assert device["cuda:0"].total == {d.device: d for d in without.devices}["cuda:0"].total - 12 * params
    host = device["host"]
    assert host.budget == 128 * GIB and 14 * params < host.total < 14 * params + 2 * GIB
    short = plan("host", host_gib=48)  # the host's RAM is judged too
    assert not short.fits and short.refusal().startswith("host needs ")

    path = tmp_path / "c.yaml"
    path.write_text(tiny_config(config % (tmp_path, "host")))
    capsys.readouterr()
    assert main(["plan", "--config", str(path), "--gpus", "1", "--gpu-gib", "139", "--host-gib", "128"]) == 0
    out = capsys.readouterr().out
    assert "optim.offload host: 51.56 GiB of each drafter replica's device memory moved to the host" in out
    assert "fits: yes" in out


def test_a_warm_start_puts_the_drafts_weights_into_the_masters(tmp_path):
    """model.drafter_init under offload: the draft's fp32 weights become the masters (the device's copy
    is their narrowing), so training starts from the draft, not from a random init."""
    from trainer.entry import train
    from trainer.train.components import build_components

    assert train(parse_config(run_config("none", steps=3)), tmp_path / "first") == 0
    draft = tmp_path / "first" / "checkpoints" / "step_3"
    weights = ckpt.load(draft)["model"]
    cfg = parse_config(tiny_config(f"model: {{drafter_init: {draft}, dtype: bf16}}", "optim: {offload: host}"))
    c = build_components(cfg, tmp_path / "warm", log=lambda _: None)
    state = model_state(c.drafter, c.optimizer)
    assert all(torch.equal(state[k], weights[k]) for k in weights) and state.keys() == weights.keys()
    assert all(p.dtype == torch.bfloat16 for p in c.drafter.parameters())
    assert torch.equal(c.drafter.fc.weight, weights["fc.weight"].to(torch.bfloat16))
