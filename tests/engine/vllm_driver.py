"""Generation with vLLM in this process, once per engine configuration; run by the engine
tier in the engine venv (vLLM's CPU build), never imported by the tests themselves.

    python vllm_driver.py SPEC.json OUT.json

SPEC: {"target": DIR, "prompts": [[token ids], ...], "max_tokens": N,
       "runs": [{"name": "plain"}, {"name": "d1", "draft": DIR, "num_speculative_tokens": K}, ...]}
       a run with "may_fail": true records {"error": "Type: message"} where vLLM refuses it;
       "env": {NAME: VALUE} sets environment variables for that run only (VLLM_USE_V2_MODEL_RUNNER);
       "dflash2_walk": true serves a DFlash2 draft through the V1 runner (see dflash2_walk);
       "sampled": [{"name": N, "temperature": T, "top_p": P, "top_k": K, "seed": S}, ...] generates the
       prompts again on the same engine at each setting (see sampled)
OUT:  {"runs": {name: {"tokens": [[ids], ...], "num_drafts": D, "num_draft_tokens": T,
                       "num_accepted_tokens": A, "accepted_per_pos": [rounds that accepted position k],
                       "start_s": S, "generate_s": G, "sampled": {N: {"tokens", counters, "generate_s"}}}},
       "vllm": VERSION,
       "k_norm": knorm_repro(), "expand": expand_repro()}

In-process engine (no worker processes: VLLM_ENABLE_V1_MULTIPROCESSING=0 and the "uni" executor),
a 1 GiB KV cache, offline, fp32, and `generation_config="vllm"` so the only stop token is the
tokenizer's eos, as in the project's evaluation. One process for every run: vLLM is imported once.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
from collections.abc import Callable

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

SPEC_COUNTERS = {"vllm:spec_decode_num_drafts": "num_drafts",
                 "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"  # a Vector: rounds that accepted position k


def counters(llm) -> dict:
    out: dict = {v: 0 for v in SPEC_COUNTERS.values()}
    out["accepted_per_pos"] = []
    for m in llm.get_metrics():
        if m.name in SPEC_COUNTERS and hasattr(m, "value"):
            out[SPEC_COUNTERS[m.name]] += int(m.value)
        elif m.name == PER_POSITION and hasattr(m, "values"):
            values = [int(v) for v in m.values]
            out["accepted_per_pos"] = [a + b for a, b in zip(out["accepted_per_pos"] + [0] * len(values), values)]
    return out


def since(after: dict, before: dict) -> dict:
    """What the counters counted between two readings."""
    out = {k: after[k] - before[k] for k in SPEC_COUNTERS.values()}
    per_pos = before["accepted_per_pos"] + [0] * (len(after["accepted_per_pos"]) - len(before["accepted_per_pos"]))
    out["accepted_per_pos"] = [a - b for a, b in zip(after["accepted_per_pos"], per_pos)]
    return out


@contextlib.contextmanager
def dflash2_walk():
    """vLLM-CPU refuses a DFlash2 draft (docs/engine-vllm.md, "DFlash2"): its candidate walk is in the
    V2 runner's speculator only (a Triton kernel; V2 requires Triton, which has no CPU backend here),
    and the V1 runner refuses "DFlash candidate-head drafts" because its DFlashProposer would draft
    the argmax of the LM head and ignore the selector. For the duration of one run this lifts that
    guard and replaces the V1 proposer's greedy argmax, for a model with `compute_candidates`, by
    vLLM's own candidate path: `compute_candidates` (top-k, output_multiplier, soft cap) and the
    model's `candidate_selector` (_score_edges) on the draft slots' hidden states, then the greedy
    walk that `_selector_walk_kernel` computes at temperature 0 (slot 0 reads the row of candidate 0,
    every later slot the row of the candidate chosen before). Everything else (load_weights, the
    grouped convolutions' CPU path, attention, the verification) is vLLM's unchanged."""
    import torch
    from vllm.config import VllmConfig
    from vllm.v1.spec_decode.dflash import DFlashProposer

    guard, greedy = VllmConfig._is_dflash_candidate_draft, DFlashProposer._greedy_sample

    def walk(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not hasattr(self.model, "compute_candidates"):
            return greedy(self, hidden_states)
        k = self.num_speculative_tokens
        h = hidden_states.view(-1, k, hidden_states.shape[-1])
        ids, unary = self.model.compute_candidates(h.flatten(0, 1))
        ids, unary = ids.view(h.shape[0], k, -1), unary.view(h.shape[0], k, -1)
        anchors = self.input_ids[: h.shape[0] * (k + 1): k + 1]  # each request's bonus token
        scores = self.model.model.candidate_selector(ids, unary, h, anchors)  # [B, K, prev, cand]
        rows = torch.arange(h.shape[0], device=h.device)
        previous = torch.zeros(h.shape[0], dtype=torch.long, device=h.device)
        tokens = []
        for s in range(k):
            previous = scores[rows, s, previous].float().argmax(dim=-1)
            tokens.append(ids[rows, s, previous])
        return torch.stack(tokens, dim=1).flatten()

    VllmConfig._is_dflash_candidate_draft = lambda self: False  # type: ignore[method-assign]
    DFlashProposer._greedy_sample = walk  # type: ignore[method-assign]
    try:
        yield
    finally:
        VllmConfig._is_dflash_candidate_draft = guard  # type: ignore[method-assign]
        DFlashProposer._greedy_sample = greedy  # type: ignore[method-assign]


@contextlib.contextmanager
def run_env(env: dict):
    """Environment variables for one run; vLLM caches its envs once an engine has started."""
    import vllm.envs as envs

    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    if envs._is_envs_cache_enabled():
        envs.__getattr__.cache_clear()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        if envs._is_envs_cache_enabled():
            envs.__getattr__.cache_clear()


def run_one(spec: dict, run: dict) -> dict:
    with run_env(run.get("env", {})), (dflash2_walk() if run.get("dflash2_walk") else contextlib.nullcontext()):
        return serve(spec, run)


def serve(spec: dict, run: dict) -> dict:
    from vllm import LLM, SamplingParams

    # vLLM calls gc.collect() ~9 times an engine (loader, warm-up, its own gc.freeze) and unfreezes at
    # shutdown; each pass walked every object of the vLLM, torch and transformers imports. Frozen
    # here, before the engine exists, they are skipped; what the engine makes is collected as before
    # (89 -> 55 CPU-s for the tier's 14 runs, the same tokens and counters).
    gc.freeze()
    kwargs = {}
    if run.get("draft"):
        kwargs["speculative_config"] = {"method": "dflash", "model": run["draft"],
                                        "num_speculative_tokens": run["num_speculative_tokens"],
                                        "draft_sample_method": run.get("draft_sample_method", "greedy")}
    started = time.time()
    llm = LLM(model=spec["target"], dtype="float32", distributed_executor_backend="uni",
              max_model_len=spec.get("max_model_len", 512), enforce_eager=True, disable_log_stats=False,
              generation_config="vllm", seed=0, **kwargs)
    start_s = time.time() - started
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"])
    started = time.time()
    outputs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
    result = {"tokens": [list(o.outputs[0].token_ids) for o in outputs], **counters(llm),
              "start_s": round(start_s, 1), "generate_s": round(time.time() - started, 1)}
    if run.get("sampled"):
        result["sampled"] = {s["name"]: sampled(llm, spec, s) for s in run["sampled"]}
    del llm
    gc.collect()
    return result


def sampled(llm, spec: dict, settings: dict) -> dict:
    """The same prompts again on the same engine at a temperature (and top_p, top_k), prompt i with
    seed `seed + i` (vLLM's per-request generator: its draws do not depend on the batch); the
    counters are this generation's alone."""
    from vllm import SamplingParams

    before = counters(llm)
    params = [SamplingParams(temperature=settings["temperature"], top_p=settings.get("top_p", 1.0),
                             top_k=settings.get("top_k", 0), seed=settings.get("seed", 0) + i,
                             max_tokens=spec["max_tokens"]) for i in range(len(spec["prompts"]))]
    started = time.time()
    outputs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params, use_tqdm=False)
    return {"tokens": [list(o.outputs[0].token_ids) for o in outputs], **since(counters(llm), before),
            "generate_s": round(time.time() - started, 1)}


def knorm_repro() -> dict:
    """The minimal reproduction of vLLM-CPU's k_norm difference (docs/engine-vllm.md): the grouped
    RMSNorm that DFlash's `_normalize_context_k` calls with one weight row per draft layer,
    [L, head_dim], over context keys [L, tokens, kv_heads, head_dim]. Each layer's keys must be
    normed with its own row; the CPU kernel applies row 0 to every layer."""
    import torch
    from vllm import _custom_ops as ops

    torch.manual_seed(0)
    keys = torch.randn(2, 3, 1, 32)
    weight = torch.stack([torch.full((32,), 1.0), torch.full((32,), 2.0)])
    out = torch.empty_like(keys)
    ops.rms_norm(out, keys, weight, 1e-6)
    normed = keys * torch.rsqrt(keys.pow(2).mean(-1, keepdim=True) + 1e-6)
    return {"per_layer_weight": bool(torch.allclose(out, normed * weight[:, None, None, :], atol=1e-5)),
            "layer0_weight_everywhere": bool(torch.allclose(out, normed * weight[0], atol=1e-5))}


def expand_as_the_kernel(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:
    """vLLM's Triton `expand_kernel` (v1/sample/rejection_sampler.py) in torch, for the CPU override
    whose C++ op never writes a float32 / int32 output (`expand_repro`): request i's value, or
    replace_to where it equals replace_from, in its tokens cu[i-1]..cu[i]; the rest of output untouched."""
    import torch

    cu = cu_num_tokens.long()
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    n = int(cu[-1]) if cu.numel() else 0
    output[:n] = values.repeat_interleave(counts).to(output.dtype)


def use_the_kernels_expand() -> Callable:
    """Install expand_as_the_kernel where vLLM-CPU's platform takes its override (read when a worker
    starts, so before any engine): the tier then verifies drafts at T > 0 with each request's own
    temperature, top_k and top_p, as vLLM's GPU build does. Returns vLLM's own implementation."""
    from vllm.utils import cpu_triton_utils as cpu_tl

    own = cpu_tl._expand_kernel_impl
    cpu_tl._expand_kernel_impl = expand_as_the_kernel
    return own


_VLLM_EXPAND: "Callable | None" = None  # vLLM's own CPU expand, kept for expand_repro


def expand_repro() -> dict:
    """The minimal reproduction of vLLM-CPU's sampling-parameter expansion (docs/engine-vllm.md, "At a
    temperature"): the rejection sampler expands each request's temperature (top_k, top_p) to its
    draft tokens with `expand_batch_to_tokens`; on CPU `_expand_kernel_impl` hands the C++ op int64
    copies (`_ensure_int64`) of a float32 / int32 output, so the output is never written."""
    import torch
    from vllm.utils import cpu_triton_utils as cpu_tl

    x = torch.tensor([0.7, 1.0])
    out = torch.full((4,), -7.0)
    (_VLLM_EXPAND or cpu_tl._expand_kernel_impl)(out, x, torch.tensor([2, 4], dtype=torch.int32), 0, 0)
    return {"writes_output": bool(torch.equal(out, x.repeat_interleave(2))),
            "output_untouched": bool(torch.equal(out, torch.full((4,), -7.0)))}


def main(argv: list[str]) -> int:
    global _VLLM_EXPAND
    spec = json.loads(open(argv[0]).read())
    import vllm

    _VLLM_EXPAND = use_the_kernels_expand()

    runs = {}
    for run in spec["runs"]:
        try:
            runs[run["name"]] = run_one(spec, run)
        except Exception as e:  # noqa: BLE001 - a refusal the test records (may_fail), anything else re-raised
            if not run.get("may_fail"):
                raise
            runs[run["name"]] = {"error": " | ".join(f"{type(e).__name__}: {e}".splitlines()[:4])[:600]}
    with open(argv[1], "w") as f:
        json.dump({"runs": runs, "vllm": vllm.__version__, "k_norm": knorm_repro(), "expand": expand_repro()}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
