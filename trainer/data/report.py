"""`python -m trainer data-report --config C`: what the data will look like to the trainer, before
any GPU time is spent: conversations per file and format, the token-length histogram, the share
cut at data.max_length and the share of tokens that carry loss.

Only the tokenizer is loaded (from model.target.path; the synthetic one otherwise), never the model.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from trainer.data.chat import file_format, read_conversations, template_kwargs_for, trained_tokens
from trainer.data.encoding import encode_all, process_count
from trainer.run.config import TrainerConfig, data_paths, template_kwargs
from trainer.run.contract import PROMPT_LENGTH_BUCKETS, length_bucket
from trainer.run.family import Family


@dataclass
class SplitReport:
    name: str  # train | eval
    files: list[tuple[str, str, int]] = field(default_factory=list)  # (path, format, conversations)
    lengths: list[int] = field(default_factory=list)  # untruncated token counts
    kept: list[int] = field(default_factory=list)  # token counts after truncation at max_length
    kept_tokens: int = 0  # tokens after truncation at max_length
    loss_tokens: int = 0  # of those, tokens on assistant turns
    no_loss: int = 0  # conversations left with fewer than 2 loss tokens (dropped by the trainer)
    with_tools: int = 0  # conversations whose row carries function schemas (rendered by the template)
    tools_ignored: int = 0  # conversations with schemas the chat template does not render


    @property
    def conversations(self) -> int:
        return len(self.lengths)


def tools_rendered(tokenizer: Any, conversation: dict, kwargs: dict) -> bool:
    """Whether the chat template renders a row's tool schemas: its text with them differs from its
    text without them. Handing schemas to a template that ignores them is not rendering them (a
    file's first row with tools decides for the file: a template's tools block does not depend on
    the row). A template that cannot render the row at all counts as rendering (encode says why)."""
    messages = conversation["messages"]
    try:
        with_tools = tokenizer.apply_chat_template(messages, tokenize=False, **template_kwargs_for(conversation, kwargs))
        without = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception:  # noqa: BLE001 - the encoding below reports the template's own error
        return True
    return bool(with_tools != without)


def build_report(cfg: TrainerConfig, tokenizer: Any) -> list[SplitReport]:
    kwargs = template_kwargs(cfg.data)
    splits = []
    for name, paths in (("train", data_paths(cfg.data.train_path)), ("eval", data_paths(cfg.data.eval_path))):
        if not paths:
            continue
        report = SplitReport(name)
        for path in paths:
            conversations = read_conversations(path)
            report.files.append((path, file_format(path), len(conversations)))
            with_tools = [c for c in conversations if c.get("tools")]
            if with_tools and tools_rendered(tokenizer, with_tools[0], kwargs):
                report.with_tools += len(with_tools)
            elif with_tools:
                report.tools_ignored += len(with_tools)
            processes = process_count(cfg.data.workers, len(conversations))
            for ids, mask, full in encode_all(tokenizer, conversations, cfg.data.max_length, kwargs, processes):
                report.lengths.append(full)
                report.kept.append(len(ids))
                report.kept_tokens += len(ids)
                trained = trained_tokens(mask)
                report.loss_tokens += trained
                report.no_loss += trained < 2
        splits.append(report)
    return splits


def histogram(lengths: list[int], max_length: int, width: int = 40) -> list[str]:
    """Power-of-two bins up to the longest conversation; bins past max_length are marked."""
    if not lengths:
        return ["  (no conversations)"]
    top = max(lengths)
    edges = [0] + [2 ** k for k in range(4, max(5, math.ceil(math.log2(max(top, 2)))) + 1)]
    if edges[-1] < top:
        edges.append(2 ** math.ceil(math.log2(top)))
    counts = [0] * (len(edges) - 1)
    for n in lengths:
        i = next(i for i in range(len(counts)) if n <= edges[i + 1])
        counts[i] += 1
    peak = max(counts)
    lines = []
    for i, c in enumerate(counts):
        lo, hi = edges[i] + 1 if i else 0, edges[i + 1]
        bar = "#" * (round(width * c / peak) if c else 0)
        cut = "  > max_length" if lo > max_length else ("  (max_length inside)" if lo <= max_length < hi else "")
        lines.append(f"  {lo:>7}-{hi:<7} {c:>8}  {bar}{cut}")
    return lines


def by_bucket(s: SplitReport, max_length: int) -> list[str]:
    """Conversations per length bucket (trainer.run.contract.PROMPT_LENGTH_BUCKETS, the buckets τ is
    reported in), only those that hold some, and how much of each max_length cuts."""
    rows: dict[str, list[int]] = {}
    for i, n in enumerate(s.lengths):
        rows.setdefault(length_bucket(n), []).append(i)
    lines = ["  by length bucket (tokens per conversation; the buckets tau is reported in):"]
    for name, _ in PROMPT_LENGTH_BUCKETS:
        if name not in rows:
            continue
        idx = rows[name]
        total = sum(s.lengths[i] for i in idx)
        cut = total - sum(s.kept[i] for i in idx)
        truncated = sum(s.lengths[i] > max_length for i in idx)
        lines.append(f"  {name:>6} {len(idx):>8} conversations ({len(idx) / s.conversations:.1%}); truncated "
                     f"{truncated} ({truncated / len(idx):.1%}), {cut} of {total} tokens cut ({cut / max(total, 1):.1%})")
    return lines


def format_report(splits: list[SplitReport], cfg: TrainerConfig, tokenizer_name: str) -> str:
    m = cfg.data.max_length
    out = [f"tokenizer: {tokenizer_name}   max_length: {m}"
           + (f"   enable_thinking: {cfg.data.enable_thinking}" if cfg.data.enable_thinking is not None else "")]
    for s in splits:
        out.append("")
        out.append(f"{s.name}: {s.conversations} conversations")
        for path, fmt, n in s.files:
            out.append(f"  {path}: {n} ({fmt})")
        if not s.lengths:
            continue
        total = sum(s.lengths)
        truncated = sum(n > m for n in s.lengths)
        ordered = sorted(s.lengths)
        out.append(f"  tokens per conversation: min {ordered[0]}, median {ordered[len(ordered) // 2]}, "
                   f"p95 {ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))]}, max {ordered[-1]}")
        out.append(f"  truncated at max_length: {truncated} of {s.conversations} conversations "
                   f"({truncated / s.conversations:.1%}), {total - s.kept_tokens} of {total} tokens "
                   f"({(total - s.kept_tokens) / max(total, 1):.1%}) cut")
        out.append(f"  loss tokens (assistant turns): {s.loss_tokens} of {s.kept_tokens} kept tokens "
                   f"({s.loss_tokens / max(s.kept_tokens, 1):.1%})")
        if s.with_tools:
            out.append(f"  with tools (schemas rendered by the chat template): {s.with_tools} of {s.conversations}")
        if s.tools_ignored:
            out.append(f"  with tools the chat template ignores (its text is the same without them): "
                       f"{s.tools_ignored} of {s.conversations}; the schemas are not trained on")
        if s.no_loss:
            out.append(f"  {s.no_loss} conversations have fewer than 2 loss tokens after truncation "
                       "and are skipped by the trainer")
        out.append("  length histogram (tokens, conversations):")
        out.extend(histogram(s.lengths, m))
        out.extend(by_bucket(s, m))
    return "\n".join(out)


def format_family(family: Family | None, cfg: TrainerConfig) -> str:
    """The target as the trainer will see it: family, layers by kind, MoE, weights in the run's dtype,
    and whether the configured packing is exact for it."""
    if family is None:
        return "\ntarget: no readable config.json in model.target.path"
    dtype_bytes = 4 if cfg.model.dtype == "fp32" else 2
    packing = ("bucketed (data.pack_length 0)" if not cfg.data.pack_length else
               f"packed rows of {cfg.data.pack_length}: " + (f"refused ({family.pack_refusal})" if family.pack_refusal
                                                              else "exact (each conversation as if alone)"))
    return "\n".join(["", f"target: {family.summary()}", f"  layers: {family.layer_table()}",
                      f"  weights: {family.bytes(dtype_bytes) / 2**30:.1f} GiB in {cfg.model.dtype}",
                      f"  {packing}"])
