"""The regen engine's static-cache greedy decoder gives transformers' greedy tokens, row for row."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from trainer_tools.regen import static_generate, supports_static_decode


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_static_decoder_matches_hf_generate_on_left_padded_rows(family, qwen3_model_dir, llama3_model_dir):
    model_dir = qwen3_model_dir if family == "qwen3" else llama3_model_dir
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True).eval()
    assert supports_static_decode(model)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (5, 11, 2, 8, 11)]
    width, new = max(map(len, prompts)), 12
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                  eos_token_id=None, pad_token_id=0, top_k=None, use_cache=True)[:, width:]
    # prefill two rows at a time: the chunked prefill fills the same cache
    got = static_generate(model, prompts, new, stop_ids=set(), prefill_rows=2)
    assert got.tolist() == expected.tolist()
    # a batch larger than the memory holds is decoded in chunks of rows: the same tokens
    from trainer.models import decoder

    assert decoder.greedy(model, prompts, new, set(), max_rows=2).tolist() == expected.tolist()
    # a stop token: every row decodes on; rows are cut by the caller at their first stop
    stop = int(expected[1, 3])
    cut = static_generate(model, prompts, new, stop_ids={stop})
    assert cut[1, :4].tolist() == expected[1, :4].tolist()


def test_close_fails_the_queued_requests_so_their_threads_end(qwen3_model_dir):
    """Ctrl-C during regen: the engine closes; threads waiting on queued requests must not hang the exit."""
    import threading
    import time

    from trainer_tools.regen import HFEngine, RegenError, Sampling

    engine = HFEngine(str(qwen3_model_dir), Sampling(max_tokens=2), batch_size=1, gather_s=0.0)
    started = threading.Event()
    real = engine.generate

    def slow(prompts, seeds=None):
        started.set()
        time.sleep(0.5)
        return real(prompts, seeds)

    engine.generate = slow
    outcomes = []

    def ask():
        try:
            outcomes.append(engine.complete([{"role": "user", "content": "hello"}]).finish_reason)
        except RegenError as e:
            outcomes.append(str(e))

    threads = [threading.Thread(target=ask) for _ in range(4)]
    for t in threads:
        t.start()
    started.wait(30)
    engine.close()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    assert "the engine is closed" in outcomes and len(outcomes) == 4


def test_rows_that_fit_leave_room_for_activations(qwen3_model_dir):
    """The chunk size regen decodes at once on CUDA: KV caches of the rows, plus a quarter, within the
    free memory less 10 % of the device (at least 2 GiB)."""
    from trainer.models.decoder import TargetDecoder, rows_that_fit

    model = AutoModelForCausalLM.from_pretrained(qwen3_model_dir, dtype=torch.bfloat16, local_files_only=True)
    d = TargetDecoder(model)
    capacity = 900
    per_row = d.cache(1, capacity).keys[0].numel() * 2 * 2 * len(d.base.layers)  # K and V, bf16
    gib = 1 << 30
    assert rows_that_fit(d, capacity, 2 * gib + int(1.25 * per_row) * 100, 20 * gib) == 100
    assert rows_that_fit(d, capacity, 3 * gib + int(1.25 * per_row) * 100, 30 * gib) == 100  # 10 % of 30
    assert rows_that_fit(d, capacity, gib, 20 * gib) == 1  # never zero: one row is tried


def test_long_prompts_prefill_fewer_rows_at_once_with_the_same_tokens(qwen3_model_dir, monkeypatch):
    """The prefill's [rows, width, width] mask is bounded: 256 rows of 16K-token prompts would ask for
    69 GB, so they prefill 8 at a time; bounded or not, the tokens are the same."""
    from trainer.models import decoder

    assert decoder.prefill_rows_for(16384, 256) == 8
    assert decoder.prefill_rows_for(1024, 256) == 256 and decoder.prefill_rows_for(70000, 256) == 1
    model = AutoModelForCausalLM.from_pretrained(qwen3_model_dir, dtype=torch.float32, local_files_only=True).eval()
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (7, 12, 3, 12)]
    expected = decoder.greedy(model, prompts, 6, set())
    monkeypatch.setattr(decoder, "PREFILL_MASK_ELEMENTS", 12 * 12 + 1)  # one row of width 12 at a time
    assert decoder.prefill_rows_for(12, 256) == 1
    assert decoder.greedy(model, prompts, 6, set()).tolist() == expected.tolist()


def test_sampled_static_decoding_draws_each_token_from_the_model_s_distribution_whatever_the_batch(
        qwen3_model_dir, monkeypatch):
    """Sampled answers from the static decoder: row r's token t is the engine's draw (sample_next) from
    the model's own next-token distribution after the prompt and the row's tokens so far, with the noise
    of the row's stream at t, so the rows' order, the chunking of rows or of the sampling's buffers
    change nothing, and distinct streams give distinct answers."""
    from trainer.generate import sampling
    from trainer.generate.sampling import Noise, sample_next
    from trainer.generate.sampling_params import Sampling
    from trainer.models import decoder
    from trainer_tools.regen import static_generate

    model = AutoModelForCausalLM.from_pretrained(qwen3_model_dir, dtype=torch.float32, local_files_only=True).eval()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 400, (n,), generator=g).tolist() for n in (5, 9, 3, 9, 7, 4)]
    streams, new = [11, 7, 123456789, 2**31 - 1, 0, 5], 7
    for how in (Sampling(temperature=1.0, seed=3), Sampling(temperature=0.7, top_p=0.9, seed=3)):
        out = static_generate(model, prompts, new, set(), sampling=how, streams=streams)
        noise = Noise.of(how.seed, streams, "cpu")
        with torch.no_grad():
            for r, p in enumerate(prompts):
                for t in range(new):
                    logits = model(input_ids=torch.tensor([p + out[r, :t].tolist()])).logits[:, -1]
                    drawn = sample_next(logits, how, noise.select(torch.tensor([r])), torch.tensor([t]))
                    assert int(drawn) == int(out[r, t]), (how, r, t)
        order = [3, 0, 5, 1, 4, 2]
        shuffled = decoder.generate(model, [prompts[i] for i in order], new, set(), max_rows=4,
                                    picks=sampling.sampled_picks(how, [streams[i] for i in order], "cpu"))
        assert shuffled.tolist() == out[order].tolist()
        monkeypatch.setattr(sampling, "SAMPLE_BYTES", 1)  # one row's buffers at a time
        assert static_generate(model, prompts, new, set(), sampling=how, streams=streams).tolist() == out.tolist()
        monkeypatch.undo()
    same = [prompts[0]] * 4
    answers = static_generate(model, same, new, set(), sampling=Sampling(temperature=1.0), streams=[1, 2, 3, 4])
    assert len({tuple(a) for a in answers.tolist()}) > 1
    # greedy sampling is the greedy decoder
    assert static_generate(model, prompts, new, set(), sampling=Sampling(temperature=0.0)).tolist() == \
        decoder.greedy(model, prompts, new, set()).tolist()


def test_the_engine_samples_with_the_static_decoder_and_a_seeded_row_is_the_same_in_any_batch(qwen3_model_dir):
    from trainer_tools.regen import HFEngine, Sampling

    engine = HFEngine(str(qwen3_model_dir), Sampling(max_tokens=8, temperature=1.0), batch_size=8, seed=4,
                      gather_s=0.0)
    try:
        assert engine.static
        ids = engine.prompt_ids_batch([([{"role": "user", "content": f"v{i} = {i}"}], None) for i in range(4)])
        together = engine.generate(ids, seeds=[101, 102, 103, 104])
        alone = engine.generate(ids[2:3], seeds=[103])
        assert alone[0].token_ids == together[2].token_ids
        again = engine.generate([ids[0], ids[0]], seeds=[101, 999])
        assert again[0].token_ids == together[0].token_ids and again[1].token_ids != again[0].token_ids
    finally:
        engine.close()


def batches_of_trickle(model_dir, *, batch_size: int, gather_s: float, requests: int, gap_s: float) -> list[int]:
    """The batch sizes the engine decodes when `requests` conversations arrive one every `gap_s`."""
    import threading
    import time

    from trainer_tools.regen import HFEngine, Sampling

    batches: list[int] = []
    engine = HFEngine(str(model_dir), Sampling(max_tokens=1), batch_size=batch_size, gather_s=gather_s,
                      on_batch=lambda rows, width: batches.append(rows))
    threads = [threading.Thread(target=engine.complete, args=([{"role": "user", "content": f"x = {i}"}],))
               for i in range(requests)]
    try:
        for t in threads:
            t.start()
            time.sleep(gap_s)
        for t in threads:
            t.join(timeout=60)
    finally:
        engine.close()
    assert sum(batches) == requests
    return batches


def test_a_batch_gathers_while_requests_keep_coming_and_no_longer_than_its_cap(qwen3_model_dir):
    # 20 requests over ~1 s, each 0.05 s after the last: one batch, though the first waited longer than gather_s
    assert batches_of_trickle(qwen3_model_dir, batch_size=64, gather_s=0.4, requests=20, gap_s=0.05) == [20]
    # a trickle that outlasts max_gather_s (1 s here) is cut into batches there
    assert len(batches_of_trickle(qwen3_model_dir, batch_size=64, gather_s=0.1, requests=30, gap_s=0.08)) >= 2


def test_rows_are_chunked_shortest_first_each_chunk_as_many_as_fit_at_its_own_width():
    from trainer.models.decoder import length_chunks

    def fits(capacity):  # rows a device holds at a capacity: 3 narrow ones, 2 wide ones
        return 3 if capacity < 50 else 2

    # one long prompt among short ones no longer makes every chunk as narrow as its own width allows
    assert length_chunks([5, 100, 7, 90, 6], 10, fits) == [[0, 4, 2], [3, 1]]
    assert length_chunks([5, 7, 6, 8], 10, fits) == [[0, 2, 1], [3]]
    assert length_chunks([], 10, fits) == []
    assert length_chunks([4, 4], 10, lambda capacity: 1) == [[0], [1]]  # at least one row a chunk
