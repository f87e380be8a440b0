"""What a decoder is asked to sample with: the engine's request parameters and their one-line check.

Apart from trainer.generate.sampling (which imports torch) so that `python -m trainer eval` refuses a
bad --temperature or --top-p before it imports torch (1.5 CPU-seconds a process).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

SAMPLING_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy
DraftSampleMethod = Literal["greedy", "probabilistic"]
DRAFT_SAMPLE_METHODS: tuple[DraftSampleMethod, ...] = ("greedy", "probabilistic")

SEED_MAX = 0xFFFFFFFF  # the noise hashes 32-bit seeds (trainer.generate.sampling)


@dataclass(frozen=True, kw_only=True)
class Sampling:
    """How a decoder samples: the engine's request parameters (vLLM's SamplingParams temperature,
    top_p, top_k; top_k 0 and top_p 1 are off), its speculative `draft_sample_method`, and the seed
    of the noise (trainer.generate.sampling's module doc)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    draft: DraftSampleMethod = "greedy"

    def __post_init__(self) -> None:
        problem = sampling_problem(self.temperature, self.top_p, self.top_k, self.seed, self.draft)
        if problem:
            raise ValueError(problem)

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def at(self, temperature: float) -> Sampling:
        return replace(self, temperature=float(temperature))

    def label(self) -> str:
        """How a report names it: "T=0", "T=0.7 top_p=0.9", ..."""
        parts = [f"T={self.temperature:g}"]
        if not self.greedy:
            if self.top_p < 1:
                parts.append(f"top_p={self.top_p:g}")
            if self.top_k > 0:
                parts.append(f"top_k={self.top_k}")
            if self.draft != "greedy":
                parts.append(f"draft={self.draft}")
        return " ".join(parts)


def sampling_problem(temperature: float, top_p: float, top_k: int, seed: int, draft: str) -> str | None:
    """What is wrong with these sampling parameters (one line), or None."""
    if not temperature >= 0 or temperature != temperature or temperature == float("inf"):
        return f"temperature must be a finite number >= 0, not {temperature}"
    if not 0 < top_p <= 1:
        return f"top_p must be in (0, 1], not {top_p}"
    if top_k < 0:
        return f"top_k must be at least 0 (0: off), not {top_k}"
    if not 0 <= seed <= SEED_MAX:
        return f"seed must be in 0..{SEED_MAX}, not {seed}"
    if draft not in DRAFT_SAMPLE_METHODS:
        return f"draft sample method must be one of {', '.join(DRAFT_SAMPLE_METHODS)}, not {draft!r}"
    return None


GREEDY = Sampling()
