"""Serving benchmark on the user's node: the target in the user's engine without a draft, with the
exported DFlash draft, and with the engine's own n-gram prompt lookup, on the same prompts.

    python -m trainer_tools.serve_bench --engine vllm --model DIR --draft EXPORT \\
        --set mt-bench=mt_bench.jsonl --set gsm8k=gsm8k.jsonl --concurrency 1 4 16 64 \\
        --temperature 0 0.7 1.0 --top-p 0.8 --top-k 20 --chat-template-kwargs '{"enable_thinking": false}' \\
        --out bench.json

For each engine configuration (plain, dflash, ngram) the engine is started (its argv below, or
`--argv` JSON templates of your own), waited for on /v1/models, sent every set's prompts at each
concurrency (the sweep `--concurrency`) at each temperature (the sweep `--temperature`; greedy by
default) through /v1/chat/completions (`--max-tokens`, `--top-p` / `--top-k` at T > 0, request i
seeded `--seed` + i; with `--chat-template-kwargs`, e.g. thinking off), and stopped. Per
temperature, set and concurrency (each point beside plain decoding at the same settings) it reports output tokens/s, the speedup over plain, and
τ from the engine's Prometheus /metrics counted as the project counts it: (completion tokens -
requests) / draft rounds (`spec_decode_num_drafts`; vLLM's accepted-token counter also counts drafts
past max_tokens), with the acceptance per draft position from vLLM's
`spec_decode_num_accepted_tokens_per_pos` (the share of rounds that accepted position k; counted by
vLLM, so it includes drafts accepted past max_tokens). Texts are compared with plain's at T = 0
only (sampled texts differ by design).
Sets are JSONL files the user provides (no downloads): each line {"messages": [...]} (the last
assistant turn, if any, is dropped), {"prompt": "..."}, {"question": ...} (GSM8K),
{"turns": [...]} (MT-Bench: the first turn), {"problem": ...} (MATH-500) or {"text": ...} (MBPP).

Default argv (`{model}`, `{draft}`, `{port}`, `{k}` = block_size - 1 are filled in):
  vllm   plain: vllm serve {model} --port {port} --served-model-name target --generation-config vllm
         dflash: ... --speculative-config {"method": "dflash", "model": "{draft}", "num_speculative_tokens": {k}}
         ngram:  ... --speculative-config {"method": "ngram", "num_speculative_tokens": {k},
                                           "prompt_lookup_max": 3, "prompt_lookup_min": 1}
         (--draft-sample-method probabilistic adds "draft_sample_method": "probabilistic" to dflash's)
  sglang plain: python3 -m sglang.launch_server --model-path {model} --port {port} --served-model-name target
         dflash: ... --speculative-algorithm DFLASH --speculative-draft-model-path {draft}
         ngram:  ... --speculative-algorithm NGRAM --speculative-num-draft-tokens {k}
(check your SGLang release's flag names; `--argv` replaces any of them).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

MODES = ("plain", "dflash", "ngram")
VLLM = {"plain": ["vllm", "serve", "{model}", "--port", "{port}", "--served-model-name", "target",
                  "--generation-config", "vllm"]}
VLLM["dflash"] = VLLM["plain"] + ["--speculative-config", '{{"method": "dflash", "model": "{draft}", '
                                  '"num_speculative_tokens": {k}}}']
VLLM["ngram"] = VLLM["plain"] + ["--speculative-config", '{{"method": "ngram", "num_speculative_tokens": {k}, '
                                 '"prompt_lookup_max": 3, "prompt_lookup_min": 1}}']
SGLANG = {"plain": ["python3", "-m", "sglang.launch_server", "--model-path", "{model}", "--port", "{port}",
                    "--served-model-name", "target"]}
SGLANG["dflash"] = SGLANG["plain"] + ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", "{draft}"]
SGLANG["ngram"] = SGLANG["plain"] + ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "{k}"]
ENGINES = {"vllm": VLLM, "sglang": SGLANG}
DRAFTS = re.compile(r"^(?:vllm|sglang):spec_decode_num_drafts(?:_total)?(?:\{[^}]*\})?\s+([0-9.eE+-]+)$", re.M)
PER_POSITION = re.compile(r'^vllm:spec_decode_num_accepted_tokens_per_pos(?:_total)?\{[^}]*position="(\d+)"[^}]*\}'
                          r"\s+([0-9.eE+-]+)$", re.M)


def read_set(path: Path) -> list[list[dict]]:
    """A prompt set as chat message lists (see the module doc for the accepted shapes)."""
    out = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "messages" in row:
            msgs = row["messages"]
            last = max((i for i, m in enumerate(msgs) if m.get("role") == "assistant"), default=len(msgs))
            msgs = msgs[:last] if last else msgs
        else:
            key = next((k for k in ("prompt", "question", "problem", "text", "instruction") if k in row), None)
            text = row["turns"][0] if "turns" in row else row.get(key) if key else None
            if not isinstance(text, str):
                raise SystemExit(f"serve_bench: {path}:{n}: no messages, prompt, question, turns, problem or text")
            msgs = [{"role": "user", "content": text}]
        out.append(msgs)
    return out


def template_kwargs(text: str) -> dict:
    """--chat-template-kwargs: a JSON object (argparse reports the ValueError as a one-line error)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc.msg} at character {exc.pos}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, not {type(value).__name__}")
    return value


def sampling_problem(temperature: float, top_p: float, top_k: int, concurrency: list[int]) -> str | None:
    """What is wrong with the sampling settings or the sweep (one line), or None."""
    if not 0 <= temperature < float("inf"):
        return f"--temperature must be a finite number >= 0, not {temperature}"
    if not 0 < top_p <= 1:
        return f"--top-p must be in (0, 1], not {top_p}"
    if top_k < 0:
        return f"--top-k must be at least 0 (0: off), not {top_k}"
    if min(concurrency) < 1:
        return f"--concurrency must be at least 1, not {min(concurrency)}"
    return None


def fill(argv: list[str], **values: object) -> list[str]:
    return [a.format(**values) for a in argv]


def with_draft_sampling(argv: list[str], method: str) -> list[str]:
    """A vLLM argv whose --speculative-config also says how the engine proposes at T > 0 (vLLM's
    draft_sample_method: the draft's argmax, its default, or sampled from the draft and verified with its
    probabilities); an argv without --speculative-config as it is (no draft to sample)."""
    if "--speculative-config" not in argv or method == "greedy":
        return argv
    at = argv.index("--speculative-config") + 1
    return [*argv[:at], json.dumps({**json.loads(argv[at]), "draft_sample_method": method}), *argv[at + 1:]]


def http(url: str, body: dict | None = None, timeout: float = 600.0) -> bytes:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def spec_counters(text: str) -> tuple[float, list[float]]:
    """Draft rounds and accepted tokens per draft position (summed over engines) in a Prometheus
    /metrics text; (0, []) where the engine exposes none (no speculation)."""
    per_pos: dict[int, float] = {}
    for pos, value in PER_POSITION.findall(text):
        per_pos[int(pos)] = per_pos.get(int(pos), 0.0) + float(value)
    return sum(float(v) for v in DRAFTS.findall(text)), [per_pos.get(k, 0.0) for k in range(len(per_pos))]


def counters_so_far(base: str) -> tuple[float, list[float]]:
    try:
        return spec_counters(http(f"{base}/metrics").decode())
    except (urllib.error.URLError, OSError):
        return 0.0, []


def port_in_use(port: int) -> str | None:
    """Why `port` cannot be the engine's (something answers or holds it), None when it is free: a
    benchmark of whatever already listens there would be reported as the engine's."""
    with socket.socket() as probe:
        probe.settimeout(1.0)
        if probe.connect_ex(("127.0.0.1", port)) == 0:
            holders = sorted(listeners(port))
            return f"port {port} is already in use" + (f" (pid {', '.join(map(str, holders))})" if holders else "")
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the engine's server binds: TIME_WAIT is no holder
        try:
            probe.bind(("0.0.0.0", port))
        except OSError as exc:
            return f"port {port} cannot be bound: {exc.strerror}"
    return None


def listeners(port: int) -> set[int]:
    """The pids holding a socket that listens on TCP `port` (Linux /proc; empty where unreadable)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(fields[9])
    pids = set()
    for entry in Path("/proc").iterdir() if inodes else ():
        if not entry.name.isdigit():
            continue
        try:
            for fd in (entry / "fd").iterdir():
                if os.readlink(fd).removeprefix("socket:[").removesuffix("]") in inodes:
                    pids.add(int(entry.name))
                    break
        except OSError:
            continue
    return pids


def _die_with_parent() -> None:
    """In the engine's child before exec: SIGKILL when serve_bench itself dies (a SIGKILL cannot be
    caught to stop it); Linux only."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Engine:
    """One engine process: started on a port nothing holds, waited for until it (not another
    process) serves there, stopped (its process group, SIGTERM then SIGKILL) on every way out:
    a readiness timeout, an engine that exits, Ctrl-C or SIGTERM while it starts."""

    def __init__(self, argv: list[str], port: int, log: Path, timeout: float) -> None:
        self.base = f"http://127.0.0.1:{port}"
        taken = port_in_use(port)
        if taken:
            raise SystemExit(f"serve_bench: {taken}; stop what holds it or pass --port")
        self.log = open(log, "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True, preexec_fn=_die_with_parent)
        try:
            self._wait_ready(port, log, timeout)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, port: int, log: Path, timeout: float) -> None:
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"serve_bench: the engine exited {self.proc.returncode} before serving; see {log}")
            try:
                http(f"{self.base}/v1/models", timeout=5)
            except (urllib.error.URLError, OSError):
                if time.time() > deadline:
                    raise SystemExit(f"serve_bench: the engine did not serve within {timeout:.0f}s; see {log}") from None
                time.sleep(1.0)
                continue
            holders = listeners(port)
            if holders and not any(self._ours(pid) for pid in holders):
                raise SystemExit(f"serve_bench: port {port} is answered by pid {', '.join(map(str, sorted(holders)))}, "
                                 f"not by the engine it started (pid {self.proc.pid}); see {log}")
            return

    def _ours(self, pid: int) -> bool:
        """pid is the engine or in its process group (its workers)."""
        try:
            return pid == self.proc.pid or os.getpgid(pid) == self.proc.pid
        except OSError:
            return False

    def stop(self) -> None:
        """The engine's whole process group, also when its leader has already exited."""
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


@dataclass(frozen=True, kw_only=True)
class Request:
    """What every request of a run asks for besides its messages: the sampling (the engine's
    temperature / top_p / top_k; top_k 0 and top_p 1 are off and not sent; request i has seed + i) and
    the chat template's kwargs (e.g. {"enable_thinking": false})."""

    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    chat_template_kwargs: dict | None = None

    def body(self, messages: list[dict], index: int) -> dict:
        body: dict = {"model": "target", "messages": messages, "max_tokens": self.max_tokens,
                      "temperature": self.temperature}
        if self.temperature > 0:
            body["seed"] = self.seed + index
            if self.top_p < 1:
                body["top_p"] = self.top_p
            if self.top_k > 0:
                body["top_k"] = self.top_k
        if self.chat_template_kwargs:
            body["chat_template_kwargs"] = self.chat_template_kwargs
        return body


def run_set(base: str, prompts: list[list[dict]], concurrency: int, request: Request) -> dict:
    def one(item: tuple[int, list[dict]]) -> tuple[int, str]:
        answer = json.loads(http(f"{base}/v1/chat/completions", request.body(item[1], item[0])))
        return answer["usage"]["completion_tokens"], answer["choices"][0]["message"]["content"]

    drafts_before, per_pos_before = counters_so_far(base)
    started = time.time()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(one, enumerate(prompts)))
    seconds = time.time() - started
    drafts_after, per_pos_after = counters_so_far(base)
    drafts = drafts_after - drafts_before
    accepted = [a - (per_pos_before[k] if k < len(per_pos_before) else 0.0) for k, a in enumerate(per_pos_after)]
    tokens = sum(n for n, _ in answers)
    return {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": tokens / seconds,
            "tau": (tokens - len(prompts)) / drafts if drafts else None, "draft_rounds": drafts,
            "acceptance_by_position": [a / drafts for a in accepted] if drafts and accepted else None,
            "texts": [t for _, t in answers]}


def bench(argvs: dict[str, list[str]], sets: dict[str, list[list[dict]]], concurrency: list[int],
          requests: list[Request], port: int, logs: Path, timeout: float) -> dict:
    """{temperature label ("0", "0.7"): {set: {mode: {concurrency: point}}}}; each engine configuration
    is started once and serves the whole sweep."""
    results: dict = {}
    for mode, argv in argvs.items():
        engine = Engine(argv, port, logs / f"engine-{mode}.log", timeout)
        try:
            for request in requests:
                for name, prompts in sets.items():
                    for c in concurrency:
                        point = run_set(engine.base, prompts, c, request)
                        results.setdefault(f"{request.temperature:g}", {}).setdefault(name, {}).setdefault(mode, {})[c] = point
        finally:
            engine.stop()
    for label, by_set in results.items():
        for modes in by_set.values():
            for by_c in modes.values():
                for c, r in by_c.items():
                    plain = modes.get("plain", {}).get(c)
                    r["speedup"] = r["tokens_per_s"] / plain["tokens_per_s"] if plain else None
                    r["same_text_as_plain"] = (None if float(label) > 0
                                               else plain is not None and r["texts"] == plain["texts"])
    return results


def table(results: dict, concurrency: list[int]) -> str:
    """One row per set and engine configuration: τ and the acceptance by draft position pooled over
    the sweep (every concurrency's rounds), then tokens/s and the speedup over plain at each point."""
    head = ("| T | set | engine | tau | acceptance by position | "
            + " | ".join(f"tok/s @{c} | speedup @{c}" for c in concurrency) + " | same text |")
    lines = [head, "|" + "---|" * (5 + 2 * len(concurrency) + 1)]
    for label, by_set in results.items():
        lines += [f"| {label} | {row}" for row in set_rows(by_set, concurrency)]
    return "\n".join(lines)


def set_rows(by_set: dict, concurrency: list[int]) -> list[str]:
    lines = []
    for name, modes in by_set.items():
        for mode, by_c in modes.items():
            points = [by_c[c] for c in concurrency]
            pooled = pooled_tau(points)
            tau = "-" if pooled is None else f"{pooled:.3f}"
            accepted = pooled_acceptance(points)
            by_pos = "-" if accepted is None else " ".join(f"{a:.2f}" for a in accepted)
            cells = " | ".join(f"{r['tokens_per_s']:.1f} | " + ("-" if r["speedup"] is None else f"{r['speedup']:.2f}x")
                               for r in points)
            same_texts = [r["same_text_as_plain"] for r in points]
            same = "-" if None in same_texts else "yes" if all(same_texts) else "no"
            lines.append(f"{name} | {mode} | {tau} | {by_pos} | {cells} | {same} |")
    return lines


def pooled_tau(points: list[dict]) -> float | None:
    """τ over every point's rounds: produced tokens after each request's first / draft rounds."""
    rounds = sum(r["draft_rounds"] for r in points)
    return sum(r["tau"] * r["draft_rounds"] for r in points if r["tau"] is not None) / rounds if rounds else None


def pooled_acceptance(points: list[dict]) -> list[float] | None:
    """The share of all the points' rounds that accepted each draft position."""
    shares = [(r["acceptance_by_position"], r["draft_rounds"]) for r in points if r["acceptance_by_position"]]
    if not shares:
        return None
    rounds = sum(n for _, n in shares)
    return [sum(a[k] * n for a, n in shares) / rounds for k in range(min(len(a) for a, _ in shares))]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainer_tools.serve_bench", description=__doc__.split("\n")[0])
    p.add_argument("--engine", choices=sorted(ENGINES), default="vllm")
    p.add_argument("--argv", default=None, help='JSON {"plain": [...], "dflash": [...], "ngram": [...]} templates')
    p.add_argument("--model", required=True, help="the target's model directory")
    p.add_argument("--draft", required=True, help="the exported draft directory (python -m trainer export)")
    p.add_argument("--block-size", type=int, default=None, help="default: the draft's config.json block_size")
    p.add_argument("--set", action="append", required=True, metavar="NAME=FILE.jsonl[,NAME=FILE...]", dest="sets")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="the sweep: e.g. 1 4 16 64")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0], help="the sweep: e.g. 0 0.7 1.0 (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="1: off (default)")
    p.add_argument("--top-k", type=int, default=0, help="0: off (default)")
    p.add_argument("--seed", type=int, default=0, help="request i is seeded SEED + i (at a temperature)")
    p.add_argument("--draft-sample-method", choices=["greedy", "probabilistic"], default="greedy",
                   help="vLLM's proposals at T > 0: the draft's argmax (its default), or sampled from the draft")
    p.add_argument("--chat-template-kwargs", type=template_kwargs, default=None, metavar="JSON",
                   help='e.g. \'{"enable_thinking": false}\' (thinking off), sent with every request')
    p.add_argument("--limit", type=int, default=None, help="at most this many prompts per set")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--serve-timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, required=True, help="JSON results (engine logs beside it)")
    a = p.parse_args(argv)
    problem = next(filter(None, (sampling_problem(t, a.top_p, a.top_k, a.concurrency) for t in a.temperature)), None)
    if problem:
        p.error(problem)
    if a.draft_sample_method != "greedy" and a.engine != "vllm":
        p.error(f"--draft-sample-method {a.draft_sample_method}: vLLM's setting; for {a.engine}, its own flag in --argv")

    def terminated(signum: int, _frame: object) -> None:  # SIGTERM (a playbook's stop): the engines stop too
        raise SystemExit(f"serve_bench: terminated by {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, terminated)
    block = a.block_size or json.loads((Path(a.draft) / "config.json").read_text())["block_size"]
    templates = {**ENGINES[a.engine], **(json.loads(a.argv) if a.argv else {})}  # "{}": the defaults
    argvs = {m: fill(templates[m], model=a.model, draft=a.draft, port=a.port, k=block - 1) for m in a.modes}
    if "dflash" in argvs:
        argvs["dflash"] = with_draft_sampling(argvs["dflash"], a.draft_sample_method)
    sets = {}
    for item in (part for given in a.sets for part in given.split(",") if part):
        name, _, path = item.partition("=")
        sets[name] = read_set(Path(path))[: a.limit]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    requests = [Request(max_tokens=a.max_tokens, temperature=t, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                        chat_template_kwargs=a.chat_template_kwargs) for t in dict.fromkeys(a.temperature)]
    results = bench(argvs, sets, sorted(set(a.concurrency)), requests, a.port, a.out.parent, a.serve_timeout)
    a.out.write_text(json.dumps({"argv": argvs, "max_tokens": a.max_tokens, "temperatures": a.temperature,
                                 "top_p": a.top_p, "top_k": a.top_k, "seed": a.seed,
                                 "chat_template_kwargs": a.chat_template_kwargs, "results": results}, indent=1))
    print(table(results, sorted(set(a.concurrency))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
