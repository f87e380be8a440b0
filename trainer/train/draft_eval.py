"""τ of any draft without training: `python -m trainer eval` (trainer/__main__.py is its skin).

A draft is a trainer checkpoint (checkpoints/step_N, or a run directory: its latest), this
project's export or any published DFlash/DFlash2 draft (read by trainer.models.export.read_published,
whose layout is trainer.run.layout's reading of config.json). It is decoded against the config's
target on the config's held-out conversations (or a given JSONL file) at each temperature, sampled
and expected τ beside n-gram prompt lookup's (trainer.generate.evaluate.temperature_reports). The
draft decides its own architecture, kind and block size; the config gives the target, the data, the
chat template and the eval settings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

from trainer.generate.evaluate import eval_sampling, headroom_reports, temperature_reports
from trainer.models.target_loading import complete_for_decoding
from trainer.run.config import ConfigError, DrafterShapeConfig, TrainerConfig, template_kwargs
from trainer.run.contract import named_for


def draft_config(cfg: TrainerConfig, draft: str | Path, data: str | None = None) -> TrainerConfig:
    """cfg with `draft` as the drafter (its kind, layers and block size) and, when given, `data` as
    the held-out conversations."""
    from trainer.models.export import read_published

    try:
        published, _ = read_published(draft)
    except ValueError as e:
        raise ConfigError(f"{draft}: {e}") from None
    model = dataclasses.replace(cfg.model, drafter_init=str(draft), drafter_layers=published.num_hidden_layers,
                                block_size=published.block_size, drafter=DrafterShapeConfig(kind="dflash2" if published.kind == "dflash2" else "dflash"))
    return with_eval_data(dataclasses.replace(cfg, model=model), data)


def with_eval_data(cfg: TrainerConfig, data: str | None) -> TrainerConfig:
    """cfg with `data` (when given) as the held-out conversations."""
    if data is None:
        return cfg
    if not Path(data).is_file():
        raise ConfigError(f"--data {data}: no such file")
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_path=str(data), synthetic=None,
                                                             train_path=cfg.data.train_path or str(data)))


@contextlib.contextmanager
def _decoding(cfg: TrainerConfig, temperatures: list[float] | None,
              log: Callable[[str], None]) -> Iterator[tuple[Any, Any]]:
    """(the config's components, its eval section at `temperatures` when given), built in a throwaway run
    directory; a target that cannot decode is refused."""
    e = cfg.eval
    if temperatures:
        e = dataclasses.replace(e, temperatures=[float(t) for t in temperatures])
    from trainer.train.components import build_components

    with tempfile.TemporaryDirectory(prefix="dflash-eval-") as run_dir:
        c = build_components(cfg, Path(run_dir), log)
        if not complete_for_decoding(c.target, log):
            raise ConfigError(f"model.target: decoding needs the target's layers above the last tapped one, its "
                              f"final norm and LM head, and {cfg.model.target.path} lacks some: τ cannot be measured")
        yield c, e


def evaluate_draft(cfg: TrainerConfig, draft: str | Path, temperatures: list[float] | None = None,
                   samples: int | None = None, data: str | None = None,
                   log: Callable[[str], None] = print, ceiling: bool = False) -> dict:
    """The draft's τ report at each temperature (default the config's eval.temperatures), on
    `samples` held-out conversations (default eval.samples), judged at the assistant turns eval.turns
    picks (agent conversations: every one, so "tau_by_turn"): temperature_reports' dict plus "draft".
    ceiling: also the target drafting for itself at each temperature (acceptance_report's tau_ceiling)."""
    cfg = draft_config(cfg, draft, data)
    with _decoding(cfg, temperatures, log) as (c, e):
        report = temperature_reports(c.target.module, c.drafter, c.head, c.tokenizer,
                                     c.eval_conversations[: samples or e.samples], e.max_new_tokens, e.temperatures,
                                     eval_sampling(e), batch=e.batch, template_kwargs=template_kwargs(cfg.data),
                                     turns=e.turns, ceiling=ceiling)
    return {"draft": str(draft), "kind": cfg.model.drafter.kind, "block_size": cfg.model.block_size, **report}


def evaluate_headroom(cfg: TrainerConfig, temperatures: list[float] | None = None, samples: int | None = None,
                      data: str | None = None, log: Callable[[str], None] = print) -> dict:
    """Before any draft: n-gram lookup's τ and the target drafting for itself (the most a drafter of the
    config's model.block_size reaches with argmax proposals) at each temperature, on the held-out conversations as evaluate_draft
    picks them (trainer.generate.evaluate.headroom_reports): {"draft": None, "block_size", "temperatures"}."""
    cfg = with_eval_data(cfg, data)
    with _decoding(cfg, temperatures, log) as (c, e):
        report = headroom_reports(c.target.module, c.tokenizer, c.eval_conversations[: samples or e.samples],
                                  e.max_new_tokens, cfg.model.block_size, e.temperatures, eval_sampling(e),
                                  batch=e.batch, template_kwargs=template_kwargs(cfg.data), turns=e.turns)
    return {"draft": None, "block_size": cfg.model.block_size, **report}


COLUMNS = (("T", "temperature", "g"), ("tau", "tau", ".3f"), ("tau_expected", "tau_expected", ".3f"),
           ("tau_per_prompt", "tau_per_prompt", ".3f"), ("lookup", "tau_lookup", ".3f"),
           ("lookup_expected", "tau_lookup_expected", ".3f"), ("ratio", "tau_ratio", ".2f"), ("rounds", "rounds", "d"))
CEILING_COLUMNS = (("ceiling", "tau_ceiling", ".3f"), ("ceiling_expected", "tau_ceiling_expected", ".3f"),
                   ("ceiling/lookup", "ceiling_over_lookup", ".2f"))  # with --ceiling


HEADROOM_COLUMNS = (("T", "temperature", "g"), ("lookup", "tau_lookup", ".3f"),
                    ("lookup_expected", "tau_lookup_expected", ".3f"), *CEILING_COLUMNS)  # without a draft


def _aligned(columns: tuple, reports: Any) -> list[str]:
    """A header of the columns' names and a row per report, right-aligned ("-" where a value is None)."""
    rows = [[name for name, _, _ in columns]]
    for r in reports:
        rows.append(["-" if r.get(key) is None else format(r[key], fmt) for _, key, fmt in columns])
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    return ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in rows]


def headroom_table(report: dict) -> str:
    """evaluate_headroom's report: one row per temperature, then the ceiling's expected acceptance by draft
    position at each."""
    lines = _aligned(HEADROOM_COLUMNS, report["temperatures"].values())
    for label, r in report["temperatures"].items():
        lines.append(f"T={label} ceiling accepted by position (expected): "
                     + " ".join(f"{a:.2f}" for a in r.get("ceiling_acceptance_expected") or []))
    return "\n".join([*lines, CEILING_NOTE])


CEILING_NOTE = ("ceiling: the target's own greedy chain as the block, the most a draft proposing its argmax reaches "
                "(the engine's default); sampled proposals (--draft-sample-method probabilistic) are not bounded by it")


def table(report: dict) -> str:
    """One row per temperature: sampled and expected τ, lookup's, the ratio (and the target drafting for
    itself, when measured); then the expected acceptance by draft position, τ by prompt length, by prompt form
    (conversations with a "form"), at T = 0 by how much of the answer repeats its text, and (agent data) by
    assistant turn at each temperature. A report without a
    draft: headroom_table."""
    if report.get("draft") is None:
        return headroom_table(report)
    columns = COLUMNS + (CEILING_COLUMNS if any("tau_ceiling" in r for r in report["temperatures"].values()) else ())
    lines = _aligned(columns, report["temperatures"].values())
    for label, r in report["temperatures"].items():
        lines.append(f"T={label} accepted by position (expected): "
                     + " ".join(f"{a:.2f}" for a in r.get("acceptance_expected") or []))
        groups = [*(r.get("tau_by_length") or {}).items(),  # prompt-length buckets, forms of prompt, repetition
                  *((f"form {form}", b) for form, b in (r.get("tau_by_form") or {}).items()),
                  *((f"answers repeating {part} of their text", b) for part, b in (r.get("tau_by_repetition") or {}).items())]
        for name, b in groups:
            lookup = "" if b.get("tau_lookup") is None else f", lookup {b['tau_lookup']:.3f}"
            lines.append(f"T={label} {name}: tau {b['tau']:.3f}, expected {b['tau_expected']:.3f}{lookup} "
                         f"({b['prompts']} prompts)")
        for turn, b in (r.get("tau_by_turn") or {}).items():  # agent data (eval.turns): τ at each assistant turn
            lines.append(f"T={label} assistant turn {turn}: tau {b['tau']:.3f}, expected {b['tau_expected']:.3f} "
                         f"({b['prompts']} prompts)")
    if columns != COLUMNS:
        lines.append(CEILING_NOTE)
    return "\n".join(lines)


def write_json(report: dict[str, Any], path: str | Path) -> None:
    """The report as JSON at `path`, complete or not at all (a temp file beside it, then renamed)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(report, f, indent=1)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        shown = named_for(e, tmp, path)  # the --out the user gave, not the temp name beside it
        if shown is e:
            raise
        raise shown from None
