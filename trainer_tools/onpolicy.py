"""The drafter's own rollouts as training rows, the positions it missed weighed more
(`python -m trainer_tools.onpolicy`; the on-policy stage of issue #50, docs/objectives.md).

Every prompt is answered by speculative decoding: the drafter drafts a block, the target verifies it
with the project's rejection sampler (trainer.generate.sampling, what the engine serves with) at
`--temperature` (default 1, top-p as given), and the decoded answer is distributed as the target's
own samples at those settings whatever the drafter proposes. So the rows are target data, like
regen's, decoded along the paths the drafter actually walks when it is served (Draft-OPD trains on
the drafter's rollouts with the target as judge). Each row holds the answer's token ids
(`answer_tokens`) and one loss weight per token (`loss_weights`, trainer.data.chat.answer_weights):

* 1.0 on the drafts the target accepted, on the first token (decoded by the target alone, from the
  prompt) and on a round's bonus token (every draft accepted);
* `--miss-weight` (default 2.0) on each round's correction token: the target's own token where the
  drafter's draft at that position was rejected. These are the positions the drafter has to learn
  to serve better; 2.0 doubles their share of the loss without letting the few of them (one a round:
  about 1/τ of the tokens) outweigh the accepted ones, which the drafter must keep getting right (a
  weight large enough to dominate would trade accepted positions for missed ones). Unmeasured yet:
  the figure to choose it by is τ after a run on these rows.

It prints the rollouts' mean acceptance length, pooled over rounds (tokens produced per round,
accepted drafts + 1, the first token excluded): the drafter's on-policy τ at these settings.

Answers are decoded with their special tokens kept (a `<|im_start|>` in the middle of an answer stays
text that the template renders back to the same token). A row's `answer_tokens` are the answer's
canonical tokens, the ones the trainer trains on: the conversation rendered by the chat template and
tokenized as trainer.data.chat.encode_conversation does, the last assistant span's tokens, up to the
end of the answer's text (its end-of-turn token included when it stopped). They often differ from the
rollout's own tokens (`rollout_tokens`, weights `rollout_weights`, kept for debugging): at T = 1 the
target samples non-canonical tokenizations of its own text with a byte-level BPE ("a" then "b" where
the text encodes to "ab", a run of spaces split otherwise, a character's bytes split), which the
template's rendering never reproduces; checked token for token, 953 of 1,024 rollouts of the quality
bench's code target were lost that way. So the weights move by characters (`canonical_weights`):
each canonical token weighs the max of the weights of the rollout tokens whose characters it
overlaps. A rollout whose text the template does not render as it is in the last assistant span (a
template that rewrites content, a stop token that is not the template's end of turn) goes to the
rejected file (`--rejected`) with the reason (`kept_out`), never to the output; every written row
passes the trainer's own check (encode_conversation with its weights).

Prompts, resumability and Ctrl-C are regen's (trainer_tools.regen): one row per (prompt, sample), id
`<prompt id>#<k>`, sample k seeded from (`--seed`, prompt id, k) and decoded with that seed as its
noise stream, so it decodes the same in any batch; a rerun skips the ids in the output and the
rejected file. Ctrl-C stops after the batch being decoded (its rows are written); a second one
exits at once. The prompt is a row's turns up to its last user turn (a dataset's answer after it is
dropped; earlier assistant turns stay as context); only that last answer is decoded and weighed.
"""

from __future__ import annotations

import argparse
import bisect
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.data.chat import (
    SENTINEL,
    DataError,
    assistant_spans,
    encode_conversation,
    template_failure,
    template_kwargs_for,
)
from trainer.generate.sampling_params import DRAFT_SAMPLE_METHODS, DraftSampleMethod
from trainer_tools.regen import (
    EXIT_USAGE,
    InputError,
    Output,
    Prompt,
    exit_interrupted,
    json_object_arg,
    read_prompts,
    rejected_path,
    samples,
    sigint_interrupts,
)

MISS_WEIGHT = 2.0  # see the module docstring


def up_to_last_user(messages: list[dict]) -> list[dict]:
    """A row's turns up to its last user turn (see the module docstring): earlier assistant turns stay
    as context, only the last answer is decoded; no turns when it has no user turn."""
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    return messages[: users[-1] + 1] if users else []


def onpolicy_prompts(path: str | Path) -> list[Prompt]:
    """Each row's turns up to its last user turn, read and keyed as regen reads them (regen.read_prompts)."""
    return read_prompts(path, turns_of=up_to_last_user)[0]


def token_weights(generation: Any, drafts: int, miss_weight: float) -> list[float]:
    """One weight per generated token (trainer.generate.speculative.Generation: the first token, then
    each round's tokens, accepted drafts then the target's own): `miss_weight` on a round's own token
    when fewer than `drafts` drafts were accepted (a rejection), 1.0 elsewhere."""
    weights = [1.0] * min(1, len(generation.tokens))
    for produced, accepted in zip(generation.acceptance_lengths, generation.accepted):
        weights += [miss_weight if j == accepted and accepted < drafts else 1.0 for j in range(produced)]
    assert len(weights) == len(generation.tokens), "every generated token is the first one or a round's"
    return weights


def token_ranges(tokenizer: Any, tokens: list[int]) -> list[tuple[int, int]]:
    """Each token's character range [start, end) in tokenizer.decode(tokens) (special tokens kept).

    Decoded incrementally as a streaming detokenizer does (a window from the last point where the
    text was whole): a byte-level token can end inside a UTF-8 character (its text then ends in
    U+FFFD), so it is held and shares the range of the text that the tokens up to the one completing
    the character add; every token of such a group overlaps the character it helped write. Tokens left
    incomplete at the end share the rest of the text. DataError when the pieces are not the text."""

    def decode(ids: list[int]) -> str:
        return tokenizer.decode(ids, skip_special_tokens=False)

    text, ranges, prefix, read = "", [], 0, 0  # tokens[prefix:read] decoded already, text their pieces
    for i in range(len(tokens)):
        before, after = decode(tokens[prefix:read]), decode(tokens[prefix: i + 1])
        if len(after) > len(before) and after.startswith(before) and not after.endswith("\ufffd"):
            piece = after[len(before):]
            ranges += [(len(text), len(text) + len(piece))] * (i + 1 - read)
            text += piece
            prefix, read = read, i + 1
    whole = decode(tokens)
    if not whole.startswith(text):
        raise DataError("the tokenizer decodes the answer's tokens one by one to other text than all at once")
    return ranges + [(len(text), len(whole))] * (len(tokens) - read)


def canonical_weights(offsets: list[tuple[int, int]], ranges: list[tuple[int, int]],
                      weights: list[float]) -> list[float]:
    """One weight per canonical token (character range `offsets`): the max of the weights of the
    rollout tokens (character ranges `ranges`, same coordinates, both in text order) it overlaps,
    1.0 when it overlaps none. Max, not a mean or a sum: a missed position merged into a longer
    canonical token is still a position whose text the drafter failed to draft, and it keeps its
    weight whole (a mean would dilute it by the accepted pieces beside it, a sum would count a
    token split in three three times)."""
    ends = [e for _, e in ranges]
    starts = [s for s, _ in ranges]
    out = []
    for s, e in offsets:
        lo, hi = bisect.bisect_right(ends, s), bisect.bisect_left(starts, e)  # rollout tokens with end > s, start < e
        out.append(max((weights[j] for j in range(lo, hi) if ranges[j][0] < ranges[j][1]), default=1.0))
    return out


def canonical_answer(tokenizer: Any, messages: list[dict], template_kwargs: dict, tokens: list[int],
                     weights: list[float], finish: str) -> tuple[list[int], list[float]]:
    """(answer_tokens, loss_weights) of a rollout: the canonical tokens of the last assistant turn
    (whose content is the decoded answer) and their weights (see the module docstring). tokens and
    weights: the rollout's, its stop token last when finish is "stop". DataError naming why the
    answer's text is not in the rendered conversation as it is."""
    content = messages[-1]["content"]
    body = tokens[:-1] if finish == "stop" else tokens
    ranges = token_ranges(tokenizer, body)
    text, spans = assistant_spans(tokenizer, messages, template_kwargs)
    try:
        marked = tokenizer.apply_chat_template([*messages[:-1], {**messages[-1], "content": content + SENTINEL}],
                                               tokenize=False, **template_kwargs)
    except Exception as exc:  # noqa: BLE001 - whatever the template raises, as assistant_spans reports it
        raise DataError(template_failure(tokenizer, exc)) from None
    if not spans or marked.count(SENTINEL) != 1 or marked.replace(SENTINEL, "") != text:
        raise DataError("the chat template does not render the answer's text as it is")
    end = marked.index(SENTINEL)
    start = end - len(content)
    a, b = spans[-1]
    if text[start:end] != content or start < a or end > b:
        raise DataError("the chat template does not render the answer's text as it is in the last assistant turn")
    ranges = [(start + x, start + y) for x, y in ranges]
    if finish == "stop":
        eot = tokenizer.decode(tokens[-1:], skip_special_tokens=False)
        if not text.startswith(eot, end) or end + len(eot) > b:
            raise DataError(f"the answer stopped with {eot!r}, the chat template ends the turn with {text[end:b]!r}")
        ranges.append((end, end + len(eot)))
    last = ranges[-1][1] if ranges else end
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)  # as encode_conversation does
    ids, offsets = enc["input_ids"], [tuple(o) for o in enc["offset_mapping"]]
    lo = next((i for i, (s, _) in enumerate(offsets) if s >= a), len(ids))  # as trainer.data.chat._weighted_mask
    hi = next((i for i in range(lo, len(ids)) if offsets[i][0] >= last), len(ids))
    if hi == lo:
        raise DataError("the last assistant turn renders to no token")
    answer = (ids[lo:hi], canonical_weights(offsets[lo:hi], ranges, weights))
    encode_conversation(tokenizer, messages, len(ids) + 1, template_kwargs, answer)  # the trainer's own check
    return answer


@dataclass
class Summary:
    total: int = 0  # rows asked for (prompts x samples)
    skipped: int = 0  # already in the output or the rejected file
    written: int = 0
    retokenized: int = 0  # written with canonical tokens other than the rollout's
    rejected: int = 0  # kept out: the chat template does not render the answer's text as it is
    rounds: int = 0  # verification rounds of this run's rollouts
    produced: int = 0  # tokens those rounds produced (the first token of each answer excluded)
    missed: int = 0  # tokens weighed --miss-weight
    tokens: int = 0
    seconds: float = 0.0
    interrupted: bool = False
    rejected_path: str = ""
    examples: list[str] = field(default_factory=list)  # the first few reasons a row was kept out

    @property
    def tau(self) -> float:
        return self.produced / self.rounds if self.rounds else 0.0

    def line(self) -> str:
        text = (f"onpolicy: {self.written} rows written, {self.skipped} already done, {self.rejected} kept out "
                f"(the chat template does not render the answer's text as it is; in {self.rejected_path}); "
                f"{self.retokenized} rows re-tokenized (the rollout's tokens not the template's; weights moved by "
                f"characters); {self.tokens} rollout tokens in "
                f"{self.seconds:.1f}s; {self.missed} missed positions weighed; on-policy tau {self.tau:.3f} "
                f"({self.rounds} rounds)")
        return text


@dataclass(frozen=True, kw_only=True)
class Settings:
    """How the rollouts are decoded and weighed."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    draft_sample_method: DraftSampleMethod = "greedy"  # the engine's proposals the rollouts are decoded with
    miss_weight: float = MISS_WEIGHT
    max_tokens: int = 512
    batch: int = 16
    template_kwargs: dict = field(default_factory=dict)


class Models:
    """Target, tokenizer, drafter and the target's frozen head, on one device."""

    def __init__(self, target_dir: str, drafter_dir: str, device: str, dtype: str) -> None:
        import torch
        from transformers import AutoTokenizer

        from trainer.models.drafter import DFlashDrafter
        from trainer.models.export import read_published
        from trainer.models.hf import hf_config
        from trainer.models.target import FrozenHead
        from trainer.run.family import ModelDirError, check_model_dir
        from trainer_tools.regen import load_decoded

        torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[
            dtype if dtype != "auto" else ("bf16" if device.startswith("cuda") else "fp32")]
        try:
            check_model_dir(target_dir)
            self.tokenizer = AutoTokenizer.from_pretrained(target_dir, local_files_only=True)
            self.target = load_decoded(target_dir, device, torch_dtype)
        except ModelDirError as e:
            raise InputError(str(e).replace("model.target.path: ", "--target ")) from None
        try:
            config, weights = read_published(drafter_dir)
        except ValueError as e:
            raise InputError(f"--drafter {e}") from None
        tc = hf_config(self.target)
        problems = [f"{what} {mine} (the target's: {theirs})" for what, mine, theirs in (
            ("hidden size", config.hidden_size, tc.hidden_size), ("vocab", config.vocab_size, tc.vocab_size))
            if mine != theirs]
        if max(config.target_layer_ids) >= tc.num_hidden_layers:
            problems.append(f"target layers {config.target_layer_ids} (the target has {tc.num_hidden_layers})")
        if problems:
            raise InputError(f"--drafter {drafter_dir} was not trained for --target {target_dir}: "
                             + "; ".join(problems))
        with torch.device(device):
            self.drafter = DFlashDrafter(config)
        self.drafter.load_state_dict(weights)
        self.drafter = self.drafter.to(torch_dtype).eval()
        self.head = FrozenHead.from_target(self.target, device)
        self.stop_ids: set[int] = set()
        for source in (getattr(self.target, "generation_config", None), self.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            self.stop_ids.update(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        self.name = os.path.basename(os.path.normpath(target_dir))


def rollouts(models: Models, prompts: list[Prompt], settings: Settings) -> list[tuple[Any, list[int]]]:
    """Each prompt's speculative decoding (Generation) and its prompt's token ids."""
    from trainer.generate.evaluate import generation_prompt_ids
    from trainer.generate.sampling_params import Sampling
    from trainer.generate.speculative import speculative_generate_cached

    ids = [generation_prompt_ids(models.tokenizer, p.messages,
                                 template_kwargs_for({"tools": p.tools}, settings.template_kwargs)) for p in prompts]
    sampling = Sampling(temperature=settings.temperature, top_p=settings.top_p, seed=settings.seed,
                        draft=settings.draft_sample_method)
    streams = [int(p.seed or 0) for p in prompts]
    generations = speculative_generate_cached(models.target, models.drafter, models.head, ids, settings.max_tokens,
                                              models.stop_ids, sampling=sampling, streams=streams)
    return list(zip(generations, ids))


def record(models: Models, prompt: Prompt, generation: Any, settings: Settings, drafter: str) -> dict:
    """The training row of one rollout (see the module docstring)."""
    tokens = list(generation.tokens)
    finish = "stop" if tokens and tokens[-1] in models.stop_ids else "length"
    text = models.tokenizer.decode(tokens[:-1] if finish == "stop" else tokens, skip_special_tokens=False)
    drafts = models.drafter.config.block_size - 1
    return {"id": prompt.id, "prompt_id": prompt.id.rsplit("#", 1)[0], "sample": prompt.sample, "seed": prompt.seed,
            "messages": [*prompt.messages, {"role": "assistant", "content": text}],
            **({"tools": prompt.tools} if prompt.tools else {}),
            "rollout_tokens": tokens, "rollout_weights": token_weights(generation, drafts, settings.miss_weight),
            "finish_reasons": [finish], "model": models.name, "drafter": drafter,
            "temperature": settings.temperature, "top_p": settings.top_p,
            "draft_sample_method": settings.draft_sample_method, "miss_weight": settings.miss_weight,
            "rounds": len(generation.acceptance_lengths), "accepted": sum(generation.accepted)}


def generate_rows(models: Models, prompts: list[Prompt], output: Output, rejected: Output, settings: Settings,
                  drafter: str, interrupt: threading.Event | None = None) -> Summary:
    """Decode every prompt not yet in `output` or `rejected`, `settings.batch` at a time, each row
    given its canonical tokens and weights (canonical_answer) and appended to the output, or to
    `rejected` with the reason when it has none. Once `interrupt` is set, no batch starts."""
    s = Summary(total=len(prompts), rejected_path=str(rejected.path))
    done = output.finished | rejected.finished
    todo = [p for p in prompts if p.id not in done]
    s.skipped = len(prompts) - len(todo)
    started = time.monotonic()
    for at in range(0, len(todo), settings.batch):
        if interrupt is not None and interrupt.is_set():
            s.interrupted = True
            break
        batch = todo[at: at + settings.batch]
        for prompt, (generation, _) in zip(batch, rollouts(models, batch, settings)):
            row = record(models, prompt, generation, settings, drafter)
            try:
                tokens, weights = canonical_answer(
                    models.tokenizer, row["messages"], template_kwargs_for({"tools": prompt.tools},
                                                                           settings.template_kwargs),
                    row["rollout_tokens"], row["rollout_weights"], row["finish_reasons"][0])
            except DataError as e:
                row["kept_out"] = str(e)
                rejected.append(row)
                s.rejected += 1
                if len(s.examples) < 3:
                    s.examples.append(f"{prompt.id}: {e}")
            else:
                output.append({**row, "answer_tokens": tokens, "loss_weights": weights})
                s.written += 1
                s.retokenized += tokens != row["rollout_tokens"]
            s.rounds += len(generation.acceptance_lengths)
            s.produced += sum(generation.acceptance_lengths)
            s.missed += sum(w != 1.0 for w in row["rollout_weights"])
            s.tokens += len(row["rollout_tokens"])
        s.seconds = time.monotonic() - started
        print(f"onpolicy: {s.written + s.rejected}/{len(todo)} decoded, tau so far {s.tau:.3f}", file=sys.stderr,
              flush=True)
    s.seconds = time.monotonic() - started
    return s


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer_tools.onpolicy",
                                description="Training rows from the drafter's own speculative rollouts against the "
                                "target, the tokens where its drafts were rejected weighed --miss-weight.")
    p.add_argument("--target", required=True, help="the target's model directory (its tokenizer and chat template)")
    p.add_argument("--drafter", required=True,
                   help="the drafter: a trainer checkpoint (checkpoints/step_N, or a run directory: its latest) or an "
                        "export")
    p.add_argument("--in", dest="inp", required=True, help="prompts JSONL (messages, ShareGPT conversations, or prompt)")
    p.add_argument("--out", required=True, help="output JSONL of training rows; a rerun skips the ids already in it")
    p.add_argument("--rejected", default=None,
                   help="rows whose answer's text the chat template does not render as it is (default: OUT's name with "
                        ".rejected.jsonl)")
    p.add_argument("--samples-per-prompt", type=int, default=1, metavar="N", help="rollouts per prompt, each seeded")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="the seed the samples' seeds derive from")
    p.add_argument("--draft-sample-method", choices=DRAFT_SAMPLE_METHODS, default="greedy",
                   help="the engine's proposals the rollouts are decoded with, as you serve (vLLM's "
                   "draft_sample_method: the draft's argmax, or sampled from it)")
    p.add_argument("--miss-weight", type=float, default=MISS_WEIGHT,
                   help="loss weight of the tokens where the drafter's draft was rejected (others: 1)")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens per answer")
    p.add_argument("--batch", type=int, default=16, help="prompts decoded at once")
    p.add_argument("--limit", type=int, default=None, help="only the first N prompts of the input")
    p.add_argument("--device", default="cpu", help="torch device (cpu, cuda:0)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"],
                   help="weights dtype (auto: bf16 on CUDA, fp32 on the CPU)")
    p.add_argument("--chat-template-kwargs", default=None,
                   help='JSON object for the chat template, as training renders it, e.g. \'{"enable_thinking": false}\'')
    return p


def settings_of(args: argparse.Namespace) -> Settings:
    """The command line's Settings; InputError naming the bad option."""
    from trainer.generate.sampling_params import sampling_problem

    problem = sampling_problem(args.temperature, args.top_p, 0, args.seed % 2**32, "greedy")
    if problem:
        raise InputError(f"--temperature/--top-p: {problem}")
    if not (args.miss_weight > 0 and math.isfinite(args.miss_weight)):
        raise InputError(f"--miss-weight must be a finite number > 0 (a weight of the loss), got {args.miss_weight:g}")
    if min(args.max_tokens, args.batch, args.samples_per_prompt) < 1:
        raise InputError("--max-tokens, --batch and --samples-per-prompt must be at least 1")
    if args.samples_per_prompt > 1 and not args.temperature > 0:
        raise InputError("--samples-per-prompt above 1 needs --temperature > 0 (greedy answers to a prompt are all "
                         "the same)")
    kwargs = json_object_arg(args.chat_template_kwargs, "--chat-template-kwargs")
    return Settings(temperature=args.temperature, top_p=args.top_p, seed=args.seed % 2**32,
                    draft_sample_method=args.draft_sample_method, miss_weight=args.miss_weight,
                    max_tokens=args.max_tokens, batch=args.batch, template_kwargs=kwargs)


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    output = rejected = None
    try:
        settings = settings_of(args)
        prompts = onpolicy_prompts(args.inp)[: args.limit]
        prompts = samples(prompts, args.samples_per_prompt, args.seed)
        models = Models(args.target, args.drafter, args.device, args.dtype)
        output = Output(args.out)
        rejected = Output(rejected_path(args))
    except InputError as e:
        if output is not None:
            output.close()
        print(f"onpolicy: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"onpolicy: {len(prompts)} rollouts ({args.samples_per_prompt} per prompt) at T={settings.temperature:g}, "
          f"{len((output.finished | rejected.finished) & {p.id for p in prompts})} already done",
          file=sys.stderr, flush=True)
    interrupt = threading.Event()
    try:
        with sigint_interrupts(interrupt, None):
            summary = generate_rows(models, prompts, output, rejected, settings, str(args.drafter), interrupt)
    except KeyboardInterrupt:  # a second Ctrl-C: the rows written so far are whole lines
        summary = Summary(interrupted=True)
    finally:
        output.close()
        rejected.close()
    if summary.interrupted:
        print("onpolicy: interrupted; the rows decoded are written, the output holds whole lines only - rerun the "
              "same command to resume", file=sys.stderr, flush=True)
        return 130
    for example in summary.examples:
        print(f"onpolicy: kept out {example}", file=sys.stderr)
    print(summary.line(), flush=True)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    if code == 130:
        exit_interrupted(code)
    sys.exit(code)
