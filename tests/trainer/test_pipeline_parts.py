"""Pipeline building blocks on CPU: stop-aware queues, flat gradients, replica sums, metrics, padding."""
import copy
import threading

import pytest
import torch

from trainer.data.batches import Batch
from trainer.distributed.grad_sync import FlatGrads, ReplicaAllReduce
from trainer.models.masks import prepare_blocks
from trainer.pipeline.device_stats import BusyMeter, MetricAccumulator
from trainer.pipeline.prefetch import BatchPrefetcher, pad_rows_and_length
from trainer.pipeline.stages import StageQueue, StageThread
from trainer.run.stopping import PipelineStopped, StopSignal


def test_blocked_get_and_put_give_up_when_another_thread_fails():
    stop = StopSignal()
    empty, full = StageQueue("empty", 1, stop), StageQueue("full", 1, stop)
    full.put("x")
    outcomes = []

    def wait_on(fn):
        try:
            fn()
        except PipelineStopped:
            outcomes.append("stopped")

    waiters = [threading.Thread(target=wait_on, args=(empty.get,)),
               threading.Thread(target=wait_on, args=(lambda: full.put("y"),))]
    for t in waiters:
        t.start()
    crasher = StageThread("crasher", lambda: 1 / 0, stop)
    crasher.start()
    for t in waiters + [crasher]:
        t.join(10)
    assert outcomes == ["stopped", "stopped"]
    assert stop.error.thread == "crasher" and stop.error.message.startswith("ZeroDivisionError")


def _linear_pair():
    torch.manual_seed(0)
    a = torch.nn.Linear(4, 3)
    b = torch.nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    return a, b


def test_replica_sum_normalised_by_total_weight_equals_one_model_on_all_data():
    a, b = _linear_pair()
    ref = torch.nn.Linear(4, 3)
    ref.load_state_dict(a.state_dict())
    xs = [torch.randn(5, 4) for _ in range(3)]
    weights = [5.0, 5.0, 5.0]
    flats = [FlatGrads(list(a.parameters())), FlatGrads(list(b.parameters()))]
    reducer = ReplicaAllReduce(flats, [None, None], StopSignal())
    for model, flat, chunk in ((a, flats[0], xs[:2]), (b, flats[1], xs[2:])):
        for x in chunk:
            loss = model(x).square().sum()
            loss.backward()
            flat.add_stats(loss, torch.tensor(5.0), torch.tensor(1.0))
    threads = [threading.Thread(target=reducer.all_reduce, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    norms = [f.finish_step(max_norm=0) for f in flats]
    (sum(ref(x).square().sum() for x in xs) / sum(weights)).backward()
    for p_ref, p_a, p_b in zip(ref.parameters(), a.parameters(), b.parameters()):
        torch.testing.assert_close(p_a.grad, p_ref.grad)
        torch.testing.assert_close(p_b.grad, p_ref.grad)
    expected = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ref.parameters()]))
    torch.testing.assert_close(norms[0], expected)
    assert flats[0].stats[1].item() == 15.0 and flats[1].stats[2].item() == 3.0


def test_grads_stay_views_and_clipping_caps_the_norm():
    a, _ = _linear_pair()
    flat = FlatGrads(list(a.parameters()))
    (a(torch.randn(8, 4)) * 100).sum().backward()
    flat.add_stats(torch.tensor(0.0), torch.tensor(1.0), torch.tensor(0.0))
    flat.check_views()
    norm = flat.finish_step(max_norm=1.0)
    assert norm.item() > 1.0
    assert torch.linalg.vector_norm(flat.grads).item() == pytest.approx(1.0, rel=1e-4)
    a.zero_grad(set_to_none=True)
    with pytest.raises(RuntimeError, match="no longer a view"):
        flat.check_views()


@pytest.mark.parametrize("scale", [100.0, 1e-3])
def test_a_fused_adamw_step_takes_the_normalisation_and_clip_as_its_grad_scale(scale):
    """finish_step hands a fused AdamW the step's weight and clip as one grad scale instead of
    rewriting the gradients: the parameters and the norm match dividing, clipping and a plain AdamW."""
    a, _ = _linear_pair()
    b = copy.deepcopy(a)
    fused, plain = torch.optim.AdamW(a.parameters(), lr=1e-2, fused=True), torch.optim.AdamW(b.parameters(), lr=1e-2)
    flat = FlatGrads(list(a.parameters()))
    for _ in range(3):
        x = torch.randn(8, 4)
        (a(x) * scale).sum().backward()
        flat.add_stats(torch.tensor(0.0), torch.tensor(4.0), torch.tensor(0.0))
        norm = flat.finish_step(max_norm=1.0, optimizer=fused)
        fused.step()
        flat.zero()
        ((b(x) * scale).sum() / 4.0).backward()
        expected = torch.nn.utils.clip_grad_norm_(b.parameters(), 1.0)
        plain.step()
        plain.zero_grad()
        torch.testing.assert_close(norm, expected)
        for p_fused, p_plain in zip(a.parameters(), b.parameters()):
            torch.testing.assert_close(p_fused, p_plain)


def test_metric_windows_come_back_in_order_even_when_the_ring_is_full():
    acc = MetricAccumulator(["x", "y"], torch.device("cpu"), ring=2)
    for step in range(1, 6):
        acc.add(torch.tensor([float(step), 1.0]))
        acc.snapshot(step)
    windows = acc.completed()
    assert [(w["step"], w["x"], w["y"]) for w in windows] == [(s, float(s), 1.0) for s in range(1, 6)]


def test_busy_meter_merges_overlapping_intervals_of_threads_sharing_a_device():
    meter = BusyMeter(torch.device("cpu"))
    meter._done = [(0.0, 4.0), (2.0, 6.0), (8.0, 9.0)]
    meter._t0 -= 10.0 / 1000  # "now" is 10 ms after the meter started
    fraction = meter.busy_fraction()
    assert fraction == pytest.approx(7.0 / 10.0, rel=0.05)


def test_padding_to_a_warm_shape_adds_rows_without_blocks_or_loss():
    ids = torch.randint(1, 50, (2, 16))
    attn = torch.ones_like(ids)
    blocks = prepare_blocks(ids, torch.ones_like(ids, dtype=torch.bool), 4, 4, 7.0, 99, torch.Generator().manual_seed(0))
    p_ids, p_attn, p_blocks = pad_rows_and_length(ids, attn, blocks, (3, 32), pad_id=0)
    assert p_ids.shape == (3, 32) and p_blocks.anchors.shape == (3, 4)
    assert torch.equal(p_ids[:2, :16], ids) and torch.equal(p_blocks.weights[:2], blocks.weights)
    assert not p_blocks.valid[2].any() and p_blocks.weights[2].sum() == 0
    assert p_attn[2].tolist() == [1] + [0] * 31  # never an all-masked row
    with pytest.raises(ValueError, match="larger than its warm shape"):
        pad_rows_and_length(ids, attn, blocks, (1, 32), pad_id=0)


def test_the_prefetcher_reports_each_micro_batch_through_its_hook_before_queueing_it():
    ids = torch.randint(1, 50, (2, 16))
    gen = torch.Generator().manual_seed(0)
    stop = StopSignal()
    queues = [StageQueue("q0", 8, stop), StageQueue("q1", 8, stop)]
    seen: list[tuple[int, int, int]] = []
    prefetcher = BatchPrefetcher(
        lambda: Batch(ids, torch.ones_like(ids), torch.ones_like(ids)),
        lambda b: prepare_blocks(b.input_ids, b.loss_mask.bool(), 4, 4, 7.0, 99, gen),
        lambda: {"pos": len(seen)}, queues, stop, count=4, micro_batches=2, first_step=10,
        on_built=lambda mb: seen.append((mb.index, mb.step, mb.tokens)))
    prefetcher.run()
    assert seen == [(0, 10, 32), (1, 10, 32), (2, 11, 32), (3, 11, 32)]
    assert [queues[0].get().index, queues[1].get().index, queues[0].get().index] == [0, 1, 2]


def test_forgetting_old_data_states_is_safe_while_the_prefetcher_inserts():
    """Drafter 0 prunes the checkpoint data positions while the prefetch thread adds new ones."""
    import sys

    from trainer.pipeline.threaded import forget_states_before

    states: dict[int, dict] = {}
    done = threading.Event()

    def prefetcher():
        i = 0
        while not done.is_set():
            states[i] = {}
            i += 1
            if i % 64 == 0:
                forget_states_before(states, i - 32)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # hand the GIL over as often as possible, to expose the race
    writer = threading.Thread(target=prefetcher)
    writer.start()
    try:
        for _ in range(200_000):
            forget_states_before(states, 0)
    finally:
        done.set()
        writer.join()
        sys.setswitchinterval(interval)
