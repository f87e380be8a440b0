"""Sampled speculative decoding is lossless: the tokens it produces are distributed as plain sampling
from the target at the same temperature, top-k and top-p (trainer.generate.sampling).

Two checks, each shown to fail on a wrong rule:
* exactly, on a 3-token vocabulary: the joint distribution of the first three tokens enumerated
  through the accept rule (every draft, acceptance and residual branch) against the product of the
  target's conditionals;
* through the decoders themselves (static and dynamic cached, n-gram lookup, DFlash2's sampled walk,
  DFlash1 probabilistic drafts) on the tiny target: a chi-square test of the first three tokens of
  800 seeded decodings (fixed seed and size) against the target's exact distribution.
"""
import itertools

import pytest
import torch

from tests.trainer.test_dflash2 import SecondBestHead, dflash2_drafter
from tests.trainer.test_speculative_cached import OracleHead, bigram_target
from trainer.generate import sampling
from trainer.generate.evaluate import acceptance_report, speculative_generate
from trainer.generate.lookup import lookup_generate
from trainer.generate.sampling import Noise, processed_probs, reach
from trainer.generate.sampling_params import GREEDY, Sampling
from trainer.generate.speculative import Generation, speculative_generate_cached

V3 = 3


# ---------------------------------------------------------------------------------------------- exact, tiny vocabulary
def _table(ctx: tuple, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((ctx, salt)) % 2**31)
    return torch.randn(V3, generator=g) * 1.5


def spec_joint(s: Sampling, length: int, n: int, sampled_proposals: bool) -> dict:
    """The exact distribution of the first n tokens of speculative decoding with blocks of `length`
    drafts, enumerated through sampling.acceptance and sampling.residual: the target's
    conditionals are processed_probs of fixed random logits per context; proposals are the argmax
    of a draft model's logits, or drafts sampled from softmax(draft logits / T) (their q)."""
    dist: dict = {}

    def p_of(ctx):
        return processed_probs(_table(ctx, 0), s).double()

    def q_of(ctx):
        return (_table(ctx, 1) / s.temperature).softmax(-1).double()

    def proposals(ctx):
        if not sampled_proposals:
            drafts, c = [], ctx
            for _ in range(length):
                drafts.append(int(q_of(c).argmax()))
                c = c + (drafts[-1],)
            yield drafts, None, 1.0
            return
        for drafts in itertools.product(range(V3), repeat=length):
            qs, w, c = [], 1.0, ctx
            for x in drafts:
                qs.append(q_of(c))
                w *= float(qs[-1][x])
                c = c + (x,)
            yield list(drafts), qs, w

    def add(ctx, w):
        dist[ctx[:n]] = dist.get(ctx[:n], 0.0) + w

    def round_from(ctx, weight):
        if len(ctx) >= n:
            add(ctx, weight)
            return
        for drafts, qs, w in proposals(ctx):
            alive, c = weight * w, ctx
            for j, x in enumerate(drafts):
                if len(c) >= n:
                    add(c, alive)
                    alive = 0.0
                    break
                p = p_of(c)
                q = None if qs is None else qs[j]
                a = float(sampling.acceptance(p[x:x + 1], None if q is None else q[x:x + 1])[0])
                r = sampling.residual(p[None], torch.tensor([x]), None if q is None else q[None])[0]
                if r.sum() > 0 and a < 1:
                    for t in range(V3):
                        if r[t] > 0:
                            round_from(c + (t,), alive * (1 - a) * float(r[t] / r.sum()))
                alive *= a
                c = c + (x,)
                if alive == 0:
                    break
            if alive > 0:
                if len(c) >= n:
                    add(c, alive)
                    continue
                p = p_of(c)
                for t in range(V3):
                    if p[t] > 0:
                        round_from(c + (t,), alive * float(p[t]))

    round_from((), 1.0)
    return dist


def plain_joint(s: Sampling, n: int) -> dict:
    out = {}
    for seq in itertools.product(range(V3), repeat=n):
        w, c = 1.0, ()
        for t in seq:
            w *= float(processed_probs(_table(c, 0), s).double()[t])
            c = c + (t,)
        if w > 0:
            out[seq] = w
    return out


def max_gap(a: dict, b: dict) -> float:
    return max(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


SETTINGS = [Sampling(temperature=1.0), Sampling(temperature=0.7), Sampling(temperature=1.3, top_k=2),
            Sampling(temperature=1.0, top_p=0.6)]


@pytest.mark.parametrize("s", SETTINGS, ids=lambda s: s.label())
@pytest.mark.parametrize("sampled_proposals", [False, True], ids=["argmax-drafts", "sampled-drafts"])
def test_the_accept_rule_gives_the_targets_joint_distribution_exactly(s, sampled_proposals):
    spec = spec_joint(s, length=2, n=3, sampled_proposals=sampled_proposals)
    plain = plain_joint(s, 3)
    assert sum(spec.values()) == pytest.approx(1.0, abs=1e-6)
    assert max_gap(spec, plain) < 1e-6  # the rule computes in fp32


def test_the_exact_check_fails_on_a_wrong_accept_rule(monkeypatch):
    s = Sampling(temperature=1.0)
    plain = plain_joint(s, 3)
    right = sampling.acceptance
    # min(1, p/q) against the wrong q: the drafts were sampled from q, the ratio read as for an argmax draft
    monkeypatch.setattr(sampling, "acceptance", lambda p, q: right(p, None))
    assert max_gap(spec_joint(s, 2, 3, sampled_proposals=True), plain) > 1e-2
    monkeypatch.setattr(sampling, "acceptance", right)
    # the rejected position drawn from p itself instead of the residual
    monkeypatch.setattr(sampling, "residual", lambda p, draft, q: p)
    assert max_gap(spec_joint(s, 2, 3, sampled_proposals=False), plain) > 1e-2


def test_top_k_and_top_p_as_the_engine_masks_them():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.5, -1.0]])
    kept = processed_probs(logits, Sampling(temperature=1.0, top_k=3)) > 0
    assert kept.tolist() == [[True, True, True, True, False]]  # a tie at the k-th value is kept, as vLLM's mask
    p = logits.softmax(-1)[0]
    # top-p 0.7: the smallest set from the top whose mass reaches 0.7 (vLLM: drop where the ascending cumsum <= 0.3)
    kept = processed_probs(logits, Sampling(temperature=1.0, top_p=0.7))[0] > 0
    assert kept.tolist() == [True, True, False, False, False] and float(p[:2].sum()) >= 0.7 > float(p[0])
    # the order: temperature, top-k, then top-p over what top-k kept
    both = processed_probs(logits, Sampling(temperature=2.0, top_k=2, top_p=0.7))[0]
    assert (both > 0).tolist() == [True, True, False, False, False]
    assert int((processed_probs(logits, Sampling(temperature=2.0, top_p=0.7)) > 0).sum()) > 2  # top-p alone
    assert float(both.sum()) == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------- the decoders
PROMPT = [5, 17, 33]
N = 800
CHI2_CRITICAL = {k: c for k, c in [(5, 20.5), (8, 26.1), (11, 31.3), (14, 36.1), (17, 40.8), (20, 45.3), (23, 49.7),
                                   (26, 54.1)]}  # chi-square 0.999 quantiles by degrees of freedom


def target_joint(target, s: Sampling, n: int = 3) -> dict:
    """The target's exact distribution of its first n sampled tokens after PROMPT."""
    out = {}

    def walk(seq, w):
        if len(seq) == n:
            out[tuple(seq)] = w
            return
        with torch.no_grad():
            p = processed_probs(target(input_ids=torch.tensor([PROMPT + seq])).logits[0, -1], s).double()
        for t in torch.nonzero(p).flatten().tolist():
            walk(seq + [t], w * float(p[t]))

    walk([], 1.0)
    return out


def chi_square(samples: list[tuple], exact: dict) -> tuple[float, int]:
    """Pearson's statistic of the samples against the exact distribution (cells expected < 5 pooled)
    and its degrees of freedom; a sample outside the support makes it infinite."""
    counts: dict = {}
    for x in samples:
        counts[x] = counts.get(x, 0) + 1
    if set(counts) - set(exact):
        return float("inf"), 1
    big = [k for k, p in exact.items() if p * len(samples) >= 5]
    small = [k for k in exact if k not in big]
    cells = [([k], exact[k]) for k in big] + ([(small, sum(exact[k] for k in small))] if small else [])
    stat = 0.0
    for keys, p in cells:
        seen = sum(counts.get(k, 0) for k in keys)
        stat += (seen - p * len(samples)) ** 2 / (p * len(samples))
    return stat, len(cells) - 1


def assert_lossless(gens: list[Generation], exact: dict) -> None:
    stat, dof = chi_square([tuple(g.tokens[:3]) for g in gens], exact)
    critical = CHI2_CRITICAL[min(CHI2_CRITICAL, key=lambda d: abs(d - dof))]
    assert stat < critical, (stat, dof)


@pytest.fixture(scope="module")
def bigram(tiny):
    target, head, drafter, layer_ids = tiny
    bg = bigram_target(target)
    with torch.no_grad():
        nxt = bg(input_ids=torch.arange(head.embed_weight.shape[0])[:, None]).logits[:, -1].argmax(-1).tolist()
    return bg, dict(enumerate(nxt)), head, drafter, layer_ids


S = Sampling(temperature=1.0, top_k=3, seed=7)


def test_the_cached_decoders_sample_the_targets_distribution(bigram):
    target, successor, head, drafter, _ = bigram
    oracle = OracleHead(head, successor, wrong_every=5)
    exact = target_joint(target, S)
    assert len(exact) == 27
    prompts = [PROMPT] * N
    for implementation in ("static", "dynamic"):
        gens = speculative_generate_cached(target, drafter, oracle, prompts, 3, set(), sampling=S,
                                           implementation=implementation)
        assert_lossless(gens, exact)
        assert 0.2 < sum(g.accepted[0] > 0 for g in gens) / N < 0.9  # drafts are accepted and rejected
    assert_lossless(lookup_generate(target, [[2, 2, 2, 2]] * 4 + prompts[4:], 3, set(), 8, sampling=S)[4:], exact)


def test_the_chi_square_check_fails_on_a_wrong_residual(bigram, monkeypatch):
    target, successor, head, drafter, _ = bigram
    oracle = OracleHead(head, successor, wrong_every=5)
    exact = target_joint(target, S)
    monkeypatch.setattr(sampling, "residual", lambda p, draft, q: p)  # the rejected draft can come back
    gens = speculative_generate_cached(target, drafter, oracle, [PROMPT] * N, 3, set(), sampling=S)
    with pytest.raises(AssertionError):
        assert_lossless(gens, exact)


@pytest.mark.parametrize("kind", ["dflash2", "dflash1"])
def test_probabilistic_drafts_are_lossless(bigram, tiny, kind):
    """DFlash2's sampled candidate walk (q: softmax of the realised row's scores / T over its
    candidates) and DFlash1's sampled drafts (q: softmax(logits / T)), vLLM's draft_sample_method
    "probabilistic"; and (DFlash2, whose q is concentrated on its candidates) the check fails when
    the ratio ignores q."""
    target, successor, head, drafter, layer_ids = bigram
    oracle = SecondBestHead(head, successor)
    if kind == "dflash2":
        drafter = dflash2_drafter(tiny[0], layer_ids).eval()
    s = Sampling(temperature=1.0, top_k=3, seed=11, draft="probabilistic")
    exact = target_joint(target, s)
    gens = speculative_generate_cached(target, drafter, oracle, [PROMPT] * N, 3, set(), sampling=s)
    assert_lossless(gens, exact)
    assert sum(g.accepted[0] > 0 for g in gens) > N // 20  # some first drafts are accepted
    if kind == "dflash1":  # q spreads over the vocabulary: a wrong ratio moves little in 800 decodings
        return
    right = sampling.acceptance
    with pytest.MonkeyPatch.context() as m:
        m.setattr(sampling, "acceptance", lambda p, q: right(p, None))
        wrong = speculative_generate_cached(target, drafter, oracle, [PROMPT] * N, 3, set(), sampling=s)
        with pytest.raises(AssertionError):
            assert_lossless(wrong, exact)


def test_every_decoder_gives_the_same_sampled_tokens_for_a_seed(bigram):
    """The noise is keyed by (seed, stream, position): cached static and dynamic, the uncached
    reference and a batch of one decode a prompt alike; another seed decodes it otherwise."""
    target, successor, head, drafter, _ = bigram
    oracle = OracleHead(head, successor, wrong_every=5)
    s = Sampling(temperature=0.8, top_p=0.9, seed=3)
    prompts = [[5, 17, 33, 2, 9], [40], [90, 1, 64]]
    static = speculative_generate_cached(target, drafter, oracle, prompts, 12, set(), sampling=s,
                                         implementation="static", capacity=32)
    dynamic = speculative_generate_cached(target, drafter, oracle, prompts, 12, set(), sampling=s,
                                          implementation="dynamic")
    for r, prompt in enumerate(prompts):
        ref = speculative_generate(target, drafter, oracle, prompt, 12, set(), sampling=s, stream=r)
        (alone,) = speculative_generate_cached(target, drafter, oracle, [prompt], 12, set(), sampling=s, streams=[r])
        for g in (static[r], dynamic[r], alone):
            assert (g.tokens, g.acceptance_lengths, g.accepted) == (ref.tokens, ref.acceptance_lengths, ref.accepted)
            assert sum(g.reach, []) == pytest.approx(sum(ref.reach, []), abs=1e-5)
    other = speculative_generate_cached(target, drafter, oracle, prompts, 12, set(), sampling=Sampling(
        temperature=0.8, top_p=0.9, seed=4))
    assert [g.tokens for g in other] != [g.tokens for g in static]


def test_noise_is_keyed_and_uniform():
    noise = Noise.of(5, [0, 1, 2], "cpu")
    u = noise.uniform(torch.arange(4000).repeat(3, 1))
    assert torch.equal(u[0], Noise.of(5, [0], "cpu").uniform(torch.arange(4000)[None])[0])  # a row's own stream
    assert not torch.equal(u[0], u[1])
    assert 0 < float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01
    e = noise.exponential(torch.tensor([3, 3, 3]), torch.arange(5000))
    assert abs(float(e.mean()) - 1.0) < 0.05


# ---------------------------------------------------------------------------------------------- expected τ
def test_reach_is_the_probability_of_each_length():
    assert reach([1.0, 1.0, 0.0, 1.0], 10) == [1.0, 1.0, 0.0, 0.0]
    assert reach([0.5, 0.5, 0.5], 10) == [0.5, 0.25, 0.125]
    assert reach([0.5, 0.5, 0.5], 2) == [0.5, 0.0, 0.0]  # a round that may produce 2 tokens at most
    g = Generation([1], [])
    g.add_round([4, 9, 2], 2, {9}, 100, drafts=[4, 9, 6], probs=[0.9, 0.8, 0.7])  # draft 2 is a stop token
    assert g.acceptance_lengths == [2] and g.reach == [pytest.approx([0.9, 0.0, 0.0])]


def test_at_t0_expected_tau_equals_the_greedy_tau_exactly(components):
    """Sampled and expected τ at T = 0 are today's greedy τ, pooled, per prompt, per position and per
    length bucket, the drafter's and lookup's; the default decoding is T = 0."""
    c = components
    convs = c.eval_conversations[:3]
    greedy = acceptance_report(c.target.module, c.drafter, c.head, c.tokenizer, convs, 12, batch=2)
    zero = acceptance_report(c.target.module, c.drafter, c.head, c.tokenizer, convs, 12, batch=2,
                             sampling=Sampling(temperature=0.0, top_p=0.5, top_k=3, seed=9))
    assert zero == {**greedy, "top_p": 0.5, "top_k": 3, "sampling": "T=0"}
    assert greedy["tau_expected"] == greedy["tau"] and greedy["tau_expected_per_prompt"] == greedy["tau_per_prompt"]
    assert greedy["acceptance_expected"] == greedy["acceptance"]
    assert greedy["tau_lookup_expected"] == greedy["tau_lookup"]
    for b in greedy["tau_by_length"].values():
        assert b["tau_expected"] == b["tau"] and b["tau_lookup_expected"] == b["tau_lookup"]
    assert greedy["lookup_same_output"] is True and greedy["sampling"] == GREEDY.label() == "T=0"


def test_at_a_temperature_the_report_has_both_taus(components):
    c = components
    convs = c.eval_conversations[:3]
    hot = acceptance_report(c.target.module, c.drafter, c.head, c.tokenizer, convs, 12, batch=2,
                            sampling=Sampling(temperature=1.0, seed=1))
    assert hot["temperature"] == 1.0 and hot["lookup_same_output"] is None
    assert 1.0 <= hot["tau_expected"] <= c.drafter.config.block_size
    assert hot["tau"] == pytest.approx(1 + sum(hot["acceptance"]))
    assert hot["tau_expected"] == pytest.approx(1 + sum(hot["acceptance_expected"]))
    other = acceptance_report(c.target.module, c.drafter, c.head, c.tokenizer, convs, 12, batch=3,
                              sampling=Sampling(temperature=1.0, seed=1))  # the batch does not matter
    assert (other["histogram"], other["lookup_histogram"]) == (hot["histogram"], hot["lookup_histogram"])
    assert other["tau_expected"] == pytest.approx(hot["tau_expected"], rel=1e-6)
