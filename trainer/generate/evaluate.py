"""Speculative decoding with target + drafter, greedy or sampled, reporting the mean acceptance length τ.

This is the inference path, written independently of the training forward: one block is
drafted in a single `draft_block` call after the context of all accepted tokens, the target
verifies it, and the matching prefix plus the target's bonus token are kept. The target is
re-run on the whole sequence each round (no KV cache): simple and exact, the reference that
the KV-cached decoder in trainer.generate.speculative (what evaluation uses) is tested against.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer.data.chat import template_kwargs_for
from trainer.data.turns import TurnMode, turn_prompts
from trainer.generate.sampling import Noise, propose_sampled, sample_next, verify
from trainer.generate.sampling_params import GREEDY, Sampling
from trainer.generate.speculative import Generation
from trainer.models.drafter import DFlashDrafter
from trainer.models.target import FrozenHead


def _target_pass(target: torch.nn.Module, ids: list[int], device: torch.device | str,
                 layer_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's logits [T, V] over ids and the drafter's features of them [1, T, n*H]."""
    x = torch.tensor([ids], device=device)
    out = target(input_ids=x, output_hidden_states=True, use_cache=False)
    feats = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return out.logits[0], feats


@torch.no_grad()
def speculative_generate(target: torch.nn.Module, drafter: DFlashDrafter, head: FrozenHead, prompt: list[int],
                         max_new_tokens: int, stop_ids: set[int], sampling: Sampling = GREEDY,
                         stream: int = 0) -> Generation:
    """The uncached reference: one prompt, the target re-run on the whole sequence every round;
    sampling (trainer.generate.sampling) as the engine samples, with the noise of `stream`."""
    c = drafter.config
    tdev = next(target.parameters()).device
    ddev = head.embed_weight.device
    noise = Noise.of(sampling.seed, [stream], tdev)
    logits, feats = _target_pass(target, prompt, tdev, c.target_layer_ids)
    first = int(sample_next(logits[-1:], sampling, noise, torch.tensor([len(prompt)], device=tdev))[0])
    seq = list(prompt) + [first]
    g = Generation([first], [], [])
    going = not (seq[-1] in stop_ids or max_new_tokens <= 1)
    offsets = torch.arange(c.block_size, device=ddev)
    while going:
        start = len(seq) - 1  # the anchor: last accepted token, whose features are not needed
        block = torch.tensor([[seq[start]] + [c.mask_token_id] * (c.block_size - 1)], device=ddev)
        hidden = drafter.draft_block(feats[:, :start].to(ddev), drafter.embed_block(head.embed, block), start)
        drafted, proposal = propose_sampled(drafter, head.logits, hidden[:, 1:], block[:, 0], sampling,
                                            noise.to(ddev), (start + offsets[1:])[None])
        drafts = drafted[0].tolist()
        logits, feats = _target_pass(target, seq + drafts, tdev, c.target_layer_ids)
        verdict = verify(logits[None, start:], drafted.to(tdev), sampling, noise, torch.tensor([start], device=tdev),
                         None if proposal is None else proposal.to(tdev))
        accepted = int(verdict.accepted[0])
        going = g.add_round(drafts[:accepted] + [int(verdict.token[0])], accepted, stop_ids, max_new_tokens,
                            drafts, verdict.probs[0].tolist())
        seq = list(prompt) + g.tokens
    return g


@torch.no_grad()
def greedy_generate(target: torch.nn.Module, prompt: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """Plain greedy decoding with the target alone (the reference speculative decoding must equal)."""
    dev = next(target.parameters()).device
    seq = list(prompt)
    while len(seq) - len(prompt) < max_new_tokens:
        tok = int(target(input_ids=torch.tensor([seq], device=dev), use_cache=False).logits[0, -1].argmax())
        seq.append(tok)
        if tok in stop_ids:
            break
    return seq[len(prompt):]


def prompt_ids(tokenizer: Any, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """Everything before the last assistant turn, with the generation prompt, rendered with the
    data config's chat-template arguments (`trainer.run.config.template_kwargs`: e.g. Qwen3's
    `enable_thinking: false` pre-fills an empty think block) - the prompt training saw and the
    engine will serve."""
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return generation_prompt_ids(tokenizer, messages[:last], template_kwargs)


def generation_prompt_ids(tokenizer: Any, before: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """The turns `before` an assistant turn, rendered with the generation prompt (see prompt_ids)."""
    text = tokenizer.apply_chat_template(before, tokenize=False, add_generation_prompt=True,
                                         **(template_kwargs or {}))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def acceptance_report(target: torch.nn.Module, drafter: DFlashDrafter, head: FrozenHead, tokenizer: Any,
                      conversations: list[dict], max_new_tokens: int, batch: int = 16,
                      template_kwargs: dict | None = None, baseline: bool = True, turns: TurnMode = "last",
                      sampling: Sampling = GREEDY, ceiling: bool = False) -> dict:
    """τ over held-out conversations, decoded with KV caches (trainer.generate.speculative), `batch` at once,
    at `sampling` (greedy by default; trainer.generate.sampling: the engine's sampling and accept rule,
    prompt i decoded with noise stream i, so a prompt's figures do not depend on its batch).

    tau: pooled, total produced tokens / verification rounds; tau_per_prompt: the mean of each
    prompt's own τ (what the DFlash authors' benchmark reports); histogram[k]: rounds that
    produced k + 1 tokens (k drafts accepted, then the target's own token); acceptance[k-1]: the
    share of rounds that accepted draft position k (`position_acceptance`); prompt_tokens: the
    prompts' length in tokens, rendered with `template_kwargs` (the data config's).
    tau_expected, tau_expected_per_prompt, acceptance_expected: the same from each round's expected
    length (its drafts scored by the target's probabilities, trainer.generate.sampling.reach: no
    sampling noise within a round); at T = 0 equal to tau, tau_per_prompt and acceptance.
    temperature, top_p, top_k, sampling: the settings (sampling: their label).

    baseline: also decode the same prompts with n-gram prompt lookup (trainer.generate.lookup: no
    training, what vLLM and SGLang ship), the same target, sampling and verification: tau_lookup,
    tau_lookup_per_prompt, tau_lookup_expected, lookup_rounds, lookup_histogram, tau_ratio = tau /
    tau_lookup (what the drafter's training bought), and lookup_same_output (greedy: both decodings
    gave the same tokens, as greedy verification must; None at a temperature); tau_by_length: the
    same per prompt-length bucket (tau_by_length), per prompt form where conversations carry a "form"
    (the quality bench's other-style prompts: tau_by_form), and greedy, per bucket of how much of the answer
    repeats its own text (tau_by_repetition).

    turns: where each conversation is judged (trainer.data.turns): at its last assistant turn, or at
    every one (agent conversations: after each tool result); prompts: how many were decoded; with
    more than one turn of a conversation, tau_by_turn: the same per assistant turn index.

    ceiling: also decode the same prompts with the target drafting for itself (trainer.generate.ceiling: its
    greedy chain as the block, the same sampling and verification): tau_ceiling, tau_ceiling_expected, the τ a
    drafter of this block size reaches at best at this temperature, and ceiling_over_lookup = tau_ceiling /
    tau_lookup, the most any drafter's tau_ratio can be here."""
    from trainer.generate.speculative import speculative_generate_cached

    stop_ids = _stop_ids(tokenizer)
    chosen, prompts = _prompts(tokenizer, conversations, template_kwargs, turns)
    was_training = drafter.training
    drafter.eval()
    block_size = drafter.config.block_size
    groups = decode_batches([len(p) for p in prompts], batch, max_new_tokens + 4 * block_size)
    try:
        generations = [g for i, j in groups
                       for g in speculative_generate_cached(target, drafter, head, prompts[i:j], max_new_tokens,
                                                            stop_ids, sampling=sampling, streams=list(range(i, j)))]
    finally:
        drafter.train(was_training)
    report = {**_tau(generations, block_size), "samples": len(conversations), "prompts": len(prompts),
              "prompt_tokens": sum(len(p) for p in prompts), **settings(sampling)}
    found, looked = _without_a_drafter(target, prompts, groups, max_new_tokens, stop_ids, block_size, sampling,
                                       baseline, ceiling)
    report.update(found)
    if looked is not None:
        report.update(tau_ratio=report["tau"] / report["tau_lookup"] if report["tau_lookup"] else None,
                      lookup_same_output=([g.tokens for g in looked] == [g.tokens for g in generations]
                                          if sampling.greedy else None))
    report["tau_by_length"] = tau_by_length(prompts, generations, looked, block_size)
    if sampling.greedy:  # one answer a prompt, whichever decoding: the buckets are the same prompts for all
        report["tau_by_repetition"] = tau_by_repetition(prompts, generations, looked, block_size)
    forms = [conversations[t.conversation].get("form") for t in chosen]
    if any(isinstance(f, str) for f in forms):
        report["tau_by_form"] = tau_by_form(forms, prompts, generations, looked, block_size)
    if len(chosen) > len({t.conversation for t in chosen}):
        report["tau_by_turn"] = tau_by_turn([t.turn for t in chosen], prompts, generations, looked, block_size)
    return report


def headroom_report(target: torch.nn.Module, tokenizer: Any, conversations: list[dict], max_new_tokens: int,
                    block_size: int, batch: int = 16, template_kwargs: dict | None = None, turns: TurnMode = "last",
                    sampling: Sampling = GREEDY) -> dict:
    """What a drafter of `block_size` can buy on this target and these prompts at `sampling`, before there
    is one: n-gram lookup's τ (what serving without a drafter gets) and the target drafting for itself (the
    most a drafter proposing its argmax reaches: trainer.generate.ceiling), decoded as acceptance_report
    decodes them, and their ratio. tau_lookup,
    tau_lookup_per_prompt, tau_lookup_expected, lookup_rounds, lookup_histogram, tau_ceiling,
    tau_ceiling_expected, ceiling_rounds, ceiling_acceptance_expected (the expected acceptance of each draft
    position of the ceiling's blocks), ceiling_over_lookup, and the settings."""
    _, prompts = _prompts(tokenizer, conversations, template_kwargs, turns)
    groups = decode_batches([len(p) for p in prompts], batch, max_new_tokens + 4 * block_size)
    found, _ = _without_a_drafter(target, prompts, groups, max_new_tokens, _stop_ids(tokenizer), block_size,
                                  sampling, lookup=True, ceiling=True)
    return {**found, "block_size": block_size, "samples": len(conversations), "prompts": len(prompts),
            "prompt_tokens": sum(len(p) for p in prompts), **settings(sampling)}


def _stop_ids(tokenizer: Any) -> set[int]:
    return {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()


def _prompts(tokenizer: Any, conversations: list[dict], template_kwargs: dict | None,
             turns: TurnMode) -> tuple[list, list[list[int]]]:
    """The assistant turns judged (trainer.data.turns) and each one's prompt tokens, with the row's tools, as
    training rendered it."""
    chosen = turn_prompts(conversations, turns)
    return chosen, [generation_prompt_ids(tokenizer, t.messages,
                                          template_kwargs_for(conversations[t.conversation], template_kwargs))
                    for t in chosen]


def _without_a_drafter(target: torch.nn.Module, prompts: list[list[int]], groups: list[tuple[int, int]],
                       max_new_tokens: int, stop_ids: set[int], block_size: int, sampling: Sampling, lookup: bool,
                       ceiling: bool) -> tuple[dict, list | None]:
    """(lookup's and the ceiling's report fields, lookup's generations or None): the decodings of the same
    prompts that need no drafter (acceptance_report's baseline and ceiling)."""
    found: dict[str, Any] = {}
    looked = None
    if lookup:
        from trainer.generate.lookup import lookup_generate

        looked = [g for i, j in groups
                  for g in lookup_generate(target, prompts[i:j], max_new_tokens, stop_ids, block_size,
                                           sampling=sampling, streams=list(range(i, j)))]
        t = _tau(looked, block_size)
        found.update(tau_lookup=t["tau"], tau_lookup_per_prompt=t["tau_per_prompt"],
                     tau_lookup_expected=t["tau_expected"], lookup_rounds=t["rounds"], lookup_histogram=t["histogram"])
    if ceiling:
        from trainer.generate.ceiling import self_draft_generate

        best = _tau([g for i, j in groups
                     for g in self_draft_generate(target, prompts[i:j], max_new_tokens, stop_ids, block_size,
                                                  sampling=sampling, streams=list(range(i, j)))], block_size)
        found.update(tau_ceiling=best["tau"], tau_ceiling_expected=best["tau_expected"], ceiling_rounds=best["rounds"],
                     ceiling_acceptance_expected=best["acceptance_expected"],
                     ceiling_over_lookup=best["tau"] / found["tau_lookup"] if found.get("tau_lookup") else None)
    return found, looked


def settings(sampling: Sampling) -> dict:
    """A report's record of its sampling settings."""
    return {"temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
            "sampling": sampling.label()}


def temperature_label(temperature: float) -> str:
    """How reports key a temperature: "0", "0.7", "1"."""
    return f"{float(temperature):g}"


def eval_sampling(e: Any) -> Sampling:
    """The sampling settings of an eval config section (trainer.run.config.EvalConfig: top_p, top_k,
    seed, draft_sample_method) at T = 0; temperature_reports sets each temperature."""
    return Sampling(top_p=e.top_p, top_k=e.top_k, seed=e.seed, draft=e.draft_sample_method)


def temperature_reports(target: torch.nn.Module, drafter: DFlashDrafter, head: FrozenHead, tokenizer: Any,
                        conversations: list[dict], max_new_tokens: int, temperatures: list[float],
                        base: Sampling = GREEDY, **kwargs: Any) -> dict:
    """`acceptance_report` at each temperature (top_p, top_k, seed and draft sampling of `base`):
    the first temperature's report, with "temperatures": {temperature_label(t): the report at t}
    for all of them (the first included)."""
    reports = {temperature_label(t): acceptance_report(target, drafter, head, tokenizer, conversations,
                                                       max_new_tokens, sampling=base.at(t), **kwargs)
               for t in temperatures}
    first = reports[temperature_label(temperatures[0])]
    return {**first, "temperatures": reports}


def headroom_reports(target: torch.nn.Module, tokenizer: Any, conversations: list[dict], max_new_tokens: int,
                     block_size: int, temperatures: list[float], base: Sampling = GREEDY, **kwargs: Any) -> dict:
    """`headroom_report` at each temperature, as temperature_reports: {"temperatures": {label: report}}."""
    return {"temperatures": {temperature_label(t): headroom_report(target, tokenizer, conversations, max_new_tokens,
                                                                   block_size, sampling=base.at(t), **kwargs)
                             for t in temperatures}}


PREFILL_MASK_ELEMENTS = 1 << 31  # a decode batch's prefill mask [rows, longest, slots] holds at most this many booleans


def decode_batches(lengths: list[int], batch: int, extra_slots: int,
                   mask_elements: int = PREFILL_MASK_ELEMENTS) -> list[tuple[int, int]]:
    """[start, end) runs of consecutive prompts decoded together: at most `batch` prompts, and no more
    than the prefill's visibility mask (rows x longest prompt x (longest + extra_slots) booleans)
    keeps under `mask_elements` (one prompt alone always goes). Prompts of a few thousand tokens
    batch as `batch` says; 64 prompts of 38K tokens at once would ask for a 94 GB mask."""
    groups: list[tuple[int, int]] = []
    start, longest = 0, 0
    for i, n in enumerate(lengths):
        wider = max(longest, n)
        if i > start and (i - start >= batch or (i - start + 1) * wider * (wider + extra_slots) > mask_elements):
            groups.append((start, i))
            start, wider = i, n
        longest = wider
    if lengths:
        groups.append((start, len(lengths)))
    return groups


def tau_by_length(prompts: list[list[int]], generations: list, looked: list | None, block_size: int) -> dict:
    """Pooled τ, sampled and expected (and the lookup baseline's, when it ran) per prompt-length
    bucket (trainer.run.contract.PROMPT_LENGTH_BUCKETS), only the buckets that hold prompts:
    {bucket: {"prompts", "prompt_tokens", "tau", "tau_expected", "tau_lookup", "tau_lookup_expected",
    "tau_ratio"}}."""
    from trainer.run.contract import PROMPT_LENGTH_BUCKETS, length_bucket

    return _tau_by([length_bucket(len(p)) for p in prompts], [name for name, _ in PROMPT_LENGTH_BUCKETS], prompts,
                   generations, looked, block_size)


def tau_by_form(forms: list, prompts: list[list[int]], generations: list, looked: list | None,
                block_size: int) -> dict:
    """The same as tau_by_length per conversation form (a conversation's "form": how its prompt is put, e.g.
    the quality bench's signature / question / middle), in the order the forms first appear; "-" for none."""
    keys = [f if isinstance(f, str) else "-" for f in forms]
    return _tau_by(keys, list(dict.fromkeys(keys)), prompts, generations, looked, block_size)


# (name, upper bound) of the share of an answer's tokens that repeat its own text (repeated_share)
REPETITION_BUCKETS = (("under a third", 1 / 3), ("a third to two thirds", 2 / 3), ("two thirds or more", float("inf")))


def repeated_share(prompt: list[int], tokens: list[int], n: int = 3) -> float:
    """The share of the answer's tokens that its text had already written after the same n tokens (token t
    counts when the n tokens before it occurred earlier in prompt + answer followed by t): how much of the
    answer repeats its own text, the part n-gram lookup can draft. 0 for an empty answer."""
    seq = prompt + tokens
    followers: dict[tuple[int, ...], set[int]] = {}
    repeated = 0
    for i in range(n, len(seq)):
        key = tuple(seq[i - n:i])
        if i >= len(prompt) and seq[i] in followers.get(key, ()):
            repeated += 1
        followers.setdefault(key, set()).add(seq[i])
    return repeated / len(tokens) if tokens else 0.0


def tau_by_repetition(prompts: list[list[int]], generations: list, looked: list | None, block_size: int) -> dict:
    """The same as tau_by_length per bucket of how much of the answer repeats its own text
    (REPETITION_BUCKETS over repeated_share of each prompt's decoded answer): where lookup's τ comes from,
    and whether the drafter loses to it on repeating answers or on new text. Meant for greedy decoding,
    where every decoding of a prompt gives the same answer, so the buckets hold the same prompts for the
    drafter and for lookup."""
    def bucket(share: float) -> str:
        return next(name for name, bound in REPETITION_BUCKETS if share < bound)

    keys = [bucket(repeated_share(p, g.tokens)) for p, g in zip(prompts, generations)]
    return _tau_by(keys, [name for name, _ in REPETITION_BUCKETS], prompts, generations, looked, block_size)


def tau_by_turn(turns: list[int], prompts: list[list[int]], generations: list, looked: list | None,
                block_size: int) -> dict:
    """The same as tau_by_length per assistant turn index, counted from 1 ("1": the first answer,
    "2": the one after the first tool result, ...), the turns that hold prompts."""
    return _tau_by([str(t + 1) for t in turns], [str(t + 1) for t in sorted(set(turns))], prompts, generations,
                   looked, block_size)


def _tau_by(keys: list[str], order: list[str], prompts: list[list[int]], generations: list, looked: list | None,
            block_size: int) -> dict:
    """{key: {"prompts", "prompt_tokens", "tau", "tau_expected", "tau_lookup", "tau_lookup_expected", "tau_ratio"}}
    over the prompts of each key, in `order`."""
    members: dict[str, list[int]] = {}
    for i, key in enumerate(keys):
        members.setdefault(key, []).append(i)
    out = {}
    for name in order:
        if name not in members:
            continue
        idx = members[name]
        mine = _tau([generations[i] for i in idx], block_size)
        lookup = _tau([looked[i] for i in idx], block_size) if looked is not None else None
        tau_lookup = lookup["tau"] if lookup else None
        out[name] = {"prompts": len(idx), "prompt_tokens": sum(len(prompts[i]) for i in idx), "tau": mine["tau"],
                     "tau_expected": mine["tau_expected"], "tau_lookup": tau_lookup,
                     "tau_lookup_expected": lookup["tau_expected"] if lookup else None,
                     "tau_ratio": mine["tau"] / tau_lookup if tau_lookup else None}
    return out


def _tau(generations: list, block_size: int) -> dict:
    """Pooled and per-prompt τ, sampled and expected, histogram, position acceptance and rounds of
    some decodings (see acceptance_report)."""
    rounds = [n for g in generations for n in g.acceptance_lengths]
    per_prompt = [sum(g.acceptance_lengths) / len(g.acceptance_lengths) for g in generations if g.acceptance_lengths]
    histogram = [0] * block_size
    for n in rounds:
        histogram[n - 1] += 1
    reach = [r + [0.0] * (block_size - 1 - len(r)) for g in generations for r in g.reach]  # lookup: short rounds
    expected = [1.0 + sum(r) for r in reach]
    expected_per_prompt = [sum(g.expected_lengths) / len(g.reach) for g in generations if g.reach]
    return {"tau": sum(rounds) / len(rounds) if rounds else 0.0,
            "tau_per_prompt": sum(per_prompt) / len(per_prompt) if per_prompt else 0.0,
            "histogram": histogram, "rounds": len(rounds), "acceptance": position_acceptance(histogram),
            "tau_expected": sum(expected) / len(expected) if expected else 0.0,
            "tau_expected_per_prompt": (sum(expected_per_prompt) / len(expected_per_prompt)
                                        if expected_per_prompt else 0.0),
            "acceptance_expected": [sum(r[k] for r in reach) / max(len(reach), 1) for k in range(block_size - 1)]}


def position_acceptance(histogram: list[int]) -> list[float]:
    """acceptance[k-1]: the share of rounds that accepted draft position k (k = 1..block-1), from a
    histogram of tokens produced per round; tau = 1 + sum(acceptance)."""
    rounds = max(sum(histogram), 1)
    return [sum(histogram[k:]) / rounds for k in range(1, len(histogram))]


def mean_acceptance_length(target: torch.nn.Module, drafter: DFlashDrafter, head: FrozenHead, tokenizer: Any,
                           conversations: list[dict],
                           max_new_tokens: int) -> tuple[float, int]:
    """Pooled τ over held-out conversations and how many were decoded."""
    report = acceptance_report(target, drafter, head, tokenizer, conversations, max_new_tokens, baseline=False)
    return report["tau"], report["samples"]
