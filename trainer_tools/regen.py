"""Regenerate a chat dataset's assistant turns with the target itself (`python -m trainer_tools.regen`).

Every user turn of every conversation is answered by the target, in order, with the answers
so far as context; the dataset's own assistant turns are dropped. A row's `tools` go with every
request (the server's chat template renders them, as training does).

Agentic traces (assistant `tool_calls`, `tool` results): without `--agentic` the trace's tool
calls and tool results are kept as they are, and the target answers after each user turn and after
each run of tool results (the turns the trace's own text answers held); a record that ends at a
tool call of the target's says so (`"stopped": "tool_call"`). With `--agentic` the target acts on
its own from the trace's system and user turns, whole trajectories: each call it makes is answered
by the trace's recorded result (the same call), else by the `--tool-exec` executor, else the
trajectory ends there (`"stopped": "diverged"`); see trainer_tools.agentic and docs/agent-regen.md.
With `--check-tokens DIR` (by default with --agentic --engine hf) every conversation is rendered by
the training template and checked against the tokens the engine produced (trainer_tools.token_check);
one that differs goes to the rejected file (`--rejected`), not the output. Two engines answer:

* `OpenAIEngine`: any OpenAI-compatible server (SGLang, vLLM) at /v1/chat/completions, over
  stdlib urllib from worker threads (no dependency beyond the standard library);
* `HFEngine`: the fallback when no server exists, batched `generate` with a KV cache over
  the concurrent requests of the worker threads.

The output is JSONL, one finished conversation per line, appended whole and fsynced in
batches by one writer. A rerun skips the ids already in the output (a torn last line from a
crash is cut off first), so an interrupted regeneration resumes where it stopped and the
output never holds a half line or a duplicate. Failed conversations are never written:
a rerun retries them (a trajectory cut short by a failure or Ctrl-C is retried whole; its tool
calls are executed again).

Several answers per prompt (`--samples-per-prompt N`, at `--temperature` > 0, 1 unless given): each prompt becomes N
rows, keyed by (prompt, sample index): id `<prompt id>#<k>`, with `prompt_id`, `sample` and `seed`.
Sample k's seed is a hash of (`--seed`, the prompt's id, k), sent with each of its requests (the
server's `seed`; the HF engine seeds each batch from its rows' seeds), so samples differ from each
other and a rerun, with N the same or larger, adds only the rows still missing.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import hashlib
import http.client
import json
import os
import queue
import random
import signal
import socket
import sys
import threading
import time
import urllib.parse
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Protocol, TextIO

from trainer.data.chat import DataError, jsonl_records, prompt_messages, row_tools
from trainer_tools.agentic import Agent, ToolExecError, ToolExecutor, parse_tool_exec, run_trajectory
from trainer_tools.token_check import TokenChecker

if TYPE_CHECKING:
    import torch

EXIT_FAILURES = 1  # some conversations failed (rerun to retry them)
EXIT_USAGE = 2  # bad input or arguments
FSYNC_EVERY_S = 1.0
RETRY_STATUSES = {408, 429, 500, 502, 503, 504}
# --samples-per-prompt without --temperature: the sampling the recipe ablation's `both` data used (issue #50)
SAMPLED_TEMPERATURE = 1.0
FINISHED = ("stop", "length", "tool_calls")  # an answer that ended otherwise (abort, error, none) did not finish
CHARS_PER_TOKEN = 64  # an answer longer than this many characters per --max-tokens token is not an answer
MAX_CONSECUTIVE_FAILURES = 16


class RegenError(Exception):
    """A conversation could not be regenerated (reported, never written)."""


class InputError(ValueError):
    """Bad input: the message names file:line."""


@dataclass
class Sampling:
    max_tokens: int = 2048
    temperature: float = 0.0
    top_p: float = 1.0
    extra: dict = field(default_factory=dict)  # more request fields, e.g. chat_template_kwargs


@dataclass
class Completion:
    content: str
    finish_reason: str  # "stop" | "length" | "tool_calls" (as the server says)
    reasoning_content: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    retries: int = 0
    tool_calls: list | None = None  # the server's parsed calls (OpenAI's form), when it parses them
    token_ids: list[int] | None = None  # the tokens produced, end-of-turn token included (HF; a server asked for them)

    @property
    def calls_tool(self) -> bool:
        """Whether the answer calls a tool: parsed calls, or a `<tool_call>` block in its text."""
        return bool(self.tool_calls) or TOOL_CALL_TAG in self.content


TOOL_CALL_TAG = "<tool_call>"  # how Qwen3's and Hermes' templates open a call


class Engine(Protocol):
    def complete(self, messages: list[dict], tools: list[dict] | None = None) -> Completion: ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------- prompts


@dataclass
class Prompt:
    id: str
    messages: list[dict]  # the turns kept, in order: system, user, tool results, the trace's tool calls
    line: int
    tools: list[dict] | None = None  # the row's function schemas (OpenAI's form)
    trace: list[dict] = field(default_factory=list)  # --agentic: the whole trace (its calls and results to replay)
    sample: int | None = None  # --samples-per-prompt: this row's sample index (its id is `<prompt id>#<k>`)
    seed: int | None = None  # the seed every request of this sample carries


def sample_seed(seed: int, prompt_id: str, k: int) -> int:
    """Sample k's seed: distinct per (prompt, k), the same on every rerun (31 bits: servers take an int)."""
    digest = hashlib.sha256(f"{seed}:{prompt_id}:{k}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF


def samples(prompts: list[Prompt], n: int, seed: int) -> list[Prompt]:
    """Each prompt as n rows keyed by (prompt, sample index), the samples of a prompt side by side."""
    return [dataclasses.replace(p, id=f"{p.id}#{k}", sample=k, seed=sample_seed(seed, p.id, k))
            for p in prompts for k in range(n)]


@dataclass
class Seeded:
    """One sample's view of an engine: every request carries the sample's seed."""

    engine: Any  # OpenAIEngine or HFEngine (complete takes seed=)
    seed: int

    def complete(self, messages: list[dict], tools: list[dict] | None = None) -> Completion:
        return self.engine.complete(messages, tools, seed=self.seed)

    def close(self) -> None:
        pass


def prompt_id(row: dict, messages: list[dict], tools: list[dict] | None = None) -> str:
    if isinstance(row.get("id"), (str, int)) and not isinstance(row.get("id"), bool):
        return str(row["id"])
    blob = json.dumps({"messages": messages, "tools": tools} if tools else messages,
                      sort_keys=True, ensure_ascii=False).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()[:20]


KEPT_KEYS = {"user": ("content",), "system": ("content",), "tool": ("content", "tool_call_id", "name"),
             "assistant": ("content", "tool_calls")}


def kept_turns(messages: list[dict], agentic: bool = False) -> list[dict]:
    """The turns regeneration keeps (see the module docstring): system and user turns; unless
    agentic, also the trace's tool results and the assistant turns that made its calls."""
    keep = ("system", "user") if agentic else ("system", "user", "tool")
    return [{"role": m["role"], **{k: m[k] for k in KEPT_KEYS[m["role"]] if k in m}} for m in messages
            if m["role"] in keep or (not agentic and m["role"] == "assistant" and m.get("tool_calls"))]


def answers_after(turns: list[dict], i: int) -> bool:
    """Whether the target answers after turns[i]: a user turn, or the last of a run of tool
    results, unless the trace's own tool call comes next."""
    if turns[i]["role"] not in ("user", "tool"):
        return False
    return i + 1 == len(turns) or turns[i + 1]["role"] not in ("tool", "assistant")


def read_prompts(path: str | Path, agentic: bool = False,
                 turns_of: Callable[[list[dict]], list[dict]] | None = None) -> tuple[list[Prompt], int]:
    """Every conversation to regenerate, and how many rows repeated an earlier one exactly.

    A row's id is its `id` field, else a hash of its kept turns (and tools); an explicit id used
    twice is an error (resume would silently skip the second row). turns_of: the turns a row keeps
    (default kept_turns; trainer_tools.onpolicy keeps everything up to the last user turn)."""
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    duplicates = 0
    try:
        for lineno, row in jsonl_records(path):
            where = f"{path}:{lineno}"
            messages = prompt_messages(row, where)
            for i, m in enumerate(messages):
                if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                    raise InputError(f"{where}: turn {i + 1} needs a string 'role' and 'content'")
            kept = turns_of(messages) if turns_of else kept_turns(messages, agentic)
            if not any(m["role"] == "user" for m in kept):
                raise InputError(f"{where}: no user turn to answer")
            tools = row_tools(row, where)
            # --agentic: the trace's calls and results decide the trajectory too, so they make its id
            pid = prompt_id(row, messages if agentic else kept, tools)
            if pid in seen:
                if not pid.startswith("sha256:"):
                    raise InputError(f"{where}: id {pid!r} used again (first at line {seen[pid]})")
                duplicates += 1
                continue
            seen[pid] = lineno
            prompts.append(Prompt(pid, kept, lineno, tools, messages if agentic else []))
    except DataError as e:
        raise InputError(str(e)) from None
    return prompts, duplicates


# ---------------------------------------------------------------------------- output


class Output:
    """The JSONL being written: finished ids on open (a torn last line is cut off), then
    whole-line appends under an exclusive lock, fsynced at most every FSYNC_EVERY_S."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise InputError(f"{self.path}: another regen is writing it") from None
        self.finished, self.repaired_bytes = self._scan()
        self._last_sync = time.monotonic()

    def _scan(self) -> tuple[set[str], int]:
        """Ids of the complete lines; bytes after the last newline are a torn write, cut off."""
        with open(self.path, "rb") as f:
            data = f.read()
        good_end = data.rfind(b"\n") + 1
        finished: set[str] = set()
        for lineno, line in enumerate(data[:good_end].split(b"\n")[:-1], 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                record = None
            if not isinstance(record, dict) or "id" not in record:
                raise InputError(f"{self.path}:{lineno}: not a regen record; refusing to append to it")
            finished.add(str(record["id"]))
        torn = len(data) - good_end
        if torn:
            os.ftruncate(self.fd, good_end)
            os.fsync(self.fd)
        return finished, torn

    def append(self, record: dict) -> None:
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        view = memoryview(line)
        while view:
            view = view[os.write(self.fd, view):]
        if time.monotonic() - self._last_sync >= FSYNC_EVERY_S:
            os.fsync(self.fd)
            self._last_sync = time.monotonic()

    def close(self) -> None:
        os.fsync(self.fd)
        os.close(self.fd)


# ---------------------------------------------------------------------------- engines


def chat_url(endpoint: str) -> str:
    """http://host:port, host:port or .../v1 -> .../v1/chat/completions."""
    url = endpoint.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    if url.endswith("/chat/completions"):
        return url
    return url + ("/chat/completions" if url.endswith("/v1") else "/v1/chat/completions")


class Retry(Exception):
    """This attempt gave no valid, finished answer; another attempt may."""


class OpenAIEngine:
    """POST /v1/chat/completions (non-streaming) with retries on connection errors, timeouts,
    408/429/5xx, a response cut short and an answer that did not finish (finish_reason abort,
    an error object); endpoints are used round-robin (data-parallel servers). `timeout` bounds
    each request whole (connect, send, every byte of the answer), not one socket read."""

    def __init__(self, endpoints: list[str], model: str, sampling: Sampling, *, api_key: str | None = None,
                 timeout: float = 600.0, retries: int = 3, backoff: float = 1.0, token_ids: bool = False):
        self.token_ids = token_ids  # ask for the produced tokens (vLLM's return_token_ids) for the token check
        self.urls = [chat_url(e) for e in endpoints]
        self.model = model
        self.sampling = sampling
        self.api_key = api_key
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self._next = 0
        self._lock = threading.Lock()

    def _url(self) -> str:
        with self._lock:
            self._next += 1
            return self.urls[self._next % len(self.urls)]

    def complete(self, messages: list[dict], tools: list[dict] | None = None, *, seed: int | None = None) -> Completion:
        s = self.sampling
        body = {**s.extra, "model": self.model, "messages": messages, "max_tokens": s.max_tokens,
                "temperature": s.temperature, "top_p": s.top_p, "stream": False, **({"tools": tools} if tools else {}),
                **({"seed": seed} if seed is not None else {}),
                **({"return_token_ids": True} if self.token_ids else {})}
        data = json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = "Bearer " + self.api_key
        limit = CHARS_PER_TOKEN * s.max_tokens + 4096
        for attempt in range(self.retries + 1):
            url = self._url()
            try:
                status, raw = post(url, data, headers, self.timeout, 4 * limit + (1 << 20))
                if status != 200:
                    why = f"{url}: HTTP {status}: {_server_message(raw)}"
                    if status not in RETRY_STATUSES:
                        raise RegenError(why)
                else:
                    return _completion(json.loads(raw), attempt, limit, s.max_tokens)
            except Retry as e:
                why = f"{url}: {e}"
            except (OSError, http.client.HTTPException, ValueError) as e:  # refused, reset, timeout, cut, bad JSON
                why = f"{url}: {type(e).__name__}: {e}" if not str(e) or isinstance(e, http.client.HTTPException) \
                    else f"{url}: {e}"
            if attempt < self.retries:
                time.sleep(min(30.0, self.backoff * 2 ** attempt) * (0.5 + random.random() / 2))
        raise RegenError(f"{why} (after {self.retries + 1} attempts)")

    def close(self) -> None:
        pass


def post(url: str, data: bytes, headers: dict, timeout: float, limit: int) -> tuple[int, bytes]:
    """(status, body) of one POST, all of it within `timeout` seconds: a timer shuts the socket
    down at the deadline, so a server that trickles bytes cannot hold a request longer. A body
    cut short raises http.client.IncompleteRead; one larger than `limit` bytes is refused."""
    parts = urllib.parse.urlsplit(url)
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = cls(parts.hostname or "127.0.0.1", parts.port, timeout=timeout)
    expired = threading.Event()
    sockets: list[socket.socket] = []  # the response keeps reading the socket after conn lets go of it

    def expire() -> None:
        expired.set()
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    try:
        conn.connect()
        if conn.sock is not None:
            sockets.append(conn.sock)
        if expired.is_set():
            expire()
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("POST", path, body=data, headers=headers)
        response = conn.getresponse()
        body = response.read(limit + 1)
        if expired.is_set():
            raise OSError("expired")
        if response.length:  # the connection closed before Content-Length bytes came
            raise http.client.IncompleteRead(body, response.length)
        if len(body) > limit:
            raise Retry(f"the reply is larger than {limit} bytes")
        return response.status, body
    except (OSError, http.client.HTTPException):
        if expired.is_set():
            raise TimeoutError(f"no complete reply within --timeout {timeout:g}s") from None
        raise
    finally:
        timer.cancel()
        conn.close()


def _server_message(raw: bytes) -> str:
    try:
        doc = json.loads(raw)
        message = doc.get("error", doc).get("message") if isinstance(doc, dict) else None
        return str(message or doc)[:300]
    except (ValueError, AttributeError):
        return raw[:300].decode("utf-8", "replace")


def _completion(reply: object, retries: int, limit: int, max_tokens: int | None = None) -> Completion:
    """The answer of a reply, validated: a finished choice (finish_reason stop or length) whose
    content is text of at most `limit` characters, of no more tokens than the `max_tokens` asked
    for (an answer the target could not have produced for this request is not written); anything
    else is a Retry."""
    if not isinstance(reply, dict):
        raise Retry(f"the reply is a JSON {type(reply).__name__}, not an object")
    if reply.get("object") == "error" or "error" in reply:
        err = reply.get("error")
        error = err if isinstance(err, dict) else reply
        raise Retry(f"the server answered with an error: {str(error.get('message') or error)[:300]}")
    choices = reply.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or not isinstance(message, dict):
        raise Retry(f"unexpected reply: {json.dumps(reply)[:300]}")
    finish = choice.get("finish_reason")
    if finish not in FINISHED:
        raise Retry(f"the answer did not finish (finish_reason {finish!r})")
    content = message.get("content")
    calls = message.get("tool_calls") or None
    if calls is not None and not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
        raise Retry(f"the answer's tool_calls is {type(calls).__name__}, not a list of calls")
    if content is None and calls:  # OpenAI's shape of a turn that only calls tools
        content = ""
    reasoning = message.get("reasoning_content") or message.get("reasoning") or None
    if not isinstance(content, str) or not (reasoning is None or isinstance(reasoning, str)):
        raise Retry(f"the answer's content is {type(content).__name__}, not text")
    if len(content) + len(reasoning or "") > limit:
        raise Retry(f"the answer has {len(content) + len(reasoning or '')} characters, more than {limit} "
                    f"({CHARS_PER_TOKEN} per --max-tokens token)")
    usage = reply.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    tokens = {k: v if isinstance(v, int) and v >= 0 else 0 for k, v in usage.items()}
    if max_tokens is not None and tokens.get("completion_tokens", 0) > max_tokens:
        raise Retry(f"the server reports {tokens['completion_tokens']} completion tokens, more than the "
                    f"--max-tokens {max_tokens} asked for: not an answer to this request")
    ids = choice.get("token_ids")  # vLLM's return_token_ids
    if ids is not None and not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
        raise Retry(f"the answer's token_ids is {type(ids).__name__}, not a list of token ids")
    return Completion(content=content, finish_reason=finish, reasoning_content=reasoning,
                      prompt_tokens=tokens.get("prompt_tokens", 0), completion_tokens=tokens.get("completion_tokens", 0),
                      retries=retries, tool_calls=calls, token_ids=ids)


def quantized_checkpoint(model_path: str) -> bool:
    """Whether the directory's config.json names a quantization the trainer's loader decodes
    (trainer.run.family.QUANTIZATIONS: gpt-oss's MXFP4, block-scaled FP8)."""
    from trainer.run.family import QUANTIZATIONS, family_of_dir

    family = family_of_dir(model_path)
    return family is not None and family.quantization in QUANTIZATIONS


def load_decoded(model_path: str, device: str, dtype: torch.dtype) -> Any:
    """The whole model read by the trainer's staged loader onto `device`, its quantized weights
    decoded into `dtype` (transformers' own path for these needs accelerate and, for MXFP4, a GPU
    kernel package)."""
    from transformers import AutoConfig

    from trainer.models.stages import StagePlan
    from trainer.models.target_loading import complete_for_decoding, load_staged

    layers = int(AutoConfig.from_pretrained(model_path, local_files_only=True).get_text_config().num_hidden_layers)
    plan = StagePlan.single(layers, device)
    target = load_staged(model_path, plan, dtype, log=lambda _: None)
    said: list[str] = []
    if not complete_for_decoding(target, log=said.append):
        raise InputError(f"{model_path}: {' '.join(said)}")
    return target.module.eval()


def supports_static_decode(model: Any) -> bool:
    """Whether `static_generate` runs this model (the target decoder's rule,
    `trainer.models.decoder.supports`)."""
    from trainer.models import decoder

    return decoder.supports(model)


def static_generate(model: Any, prompts: list[list[int]], max_new_tokens: int, stop_ids: set[int],
                    prefill_rows: int = 256, cancel: threading.Event | None = None, sampling: Any = None,
                    streams: list[int] | None = None) -> torch.Tensor:
    """Answers of a whole batch from the target decoder's preallocated KV cache, greedy or sampled
    with `sampling` (a trainer.generate.sampling_params.Sampling) from each row's noise stream
    `streams[r]` (default: its index; `trainer.models.decoder.generate`): [B, new] token ids, rows
    not cut at their stop tokens; trainer.models.decoder.Cancelled at the next step once `cancel` is set."""
    from trainer.generate.sampling import sampled_picks
    from trainer.models import decoder

    picks = None
    if sampling is not None and not sampling.greedy:
        device = next(model.parameters()).device
        picks = sampled_picks(sampling, streams if streams is not None else range(len(prompts)), device)
    return decoder.generate(model, prompts, max_new_tokens, stop_ids, prefill_rows, cancel=cancel, picks=picks)


def cancel_criteria(cancel: threading.Event, width: int = 0, steps: int = 0) -> Any:
    """transformers' `generate` stopping criteria that raise trainer.models.decoder.Cancelled at the
    first step after `cancel` is set (generate checks its criteria after every token); `width` is the
    prompts' padded width, so the step it says is the tokens generated so far, of `steps`."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    from trainer.models import decoder

    class Cancel(StoppingCriteria):
        def __call__(self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any) -> torch.BoolTensor:
            decoder.check_cancel(cancel, input_ids.shape[1] - width, steps)
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]

    return StoppingCriteriaList([Cancel()])


POLL_S = 0.1  # how often the writer looks at the interrupt while it waits for an answer
TOKENIZE_ROWS = 1024  # conversations tokenized per call (the engine checks for a close between calls)
CLOSE_WAIT_S = 10.0  # how long close() waits for the generation thread to leave a cancelled batch


class HFEngine:
    """Batched Hugging Face `generate` (KV cache on) over a local model directory.

    Worker threads call `complete()` concurrently; one generation thread takes up to
    `batch_size` waiting requests at a time, left-pads them and decodes them together.
    `max_model_len` refuses a prompt that would not fit, as a server does. `on_batch(rows, width)`
    is called as each batch starts decoding (Progress.batch: a 16,384-row batch decodes for a
    minute or more without a finished answer). `close()` cancels the batch in flight at its next
    decode step: after a Ctrl-C its answers would not be written (with a 16,384-row batch in
    flight, an interrupted regen twice outlived the quality bench's 30 s before SIGKILL).

    A batch gathers for as long as requests keep coming (each within `gather_s` of the last; at most
    `max_gather_s`), not for a fixed window after its first: on an H100 host 16,384 workers queued their
    requests over more than the 1 s window, and a greedy regen decoded 2,146 rows and then 14,238,
    256 steps each, in 96 s, where the same prompts' sampled answers, one batch, took 69 s.
    """

    def __init__(self, model_path: str, sampling: Sampling, *, device: str = "cpu", dtype: str = "auto",
                 batch_size: int = 8, max_model_len: int | None = None, seed: int = 0, decode: str = "auto",
                 gather_s: float | None = None, on_batch: Callable[[int, int], None] | None = None):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.sampling = sampling
        self.batch_size = max(1, batch_size)
        self.seed = seed
        # a batch waits for more requests while they keep coming, each within gather_s of the last, until it
        # is full or has gathered for max_gather_s: 2 ms a request of a full batch, twice the pace the H100
        # host's workers queued at (2,146 in the first second)
        self.gather_s = gather_s if gather_s is not None else min(1.0, 0.02 + 0.0001 * self.batch_size)
        self.max_gather_s = max(10 * self.gather_s, 0.002 * self.batch_size)
        dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
        torch_dtype: Any = dtypes[dtype] if dtype != "auto" else "auto"
        from trainer.models.target_loading import check_finite
        from trainer.run.family import ModelDirError, check_model_dir

        try:
            check_model_dir(model_path, weights=False)
            self.tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
            if quantized_checkpoint(model_path):
                self.model = load_decoded(model_path, device, dtypes.get(dtype, torch.bfloat16))
            else:
                self.model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True, dtype=torch_dtype)
                self.model.to(device).eval()  # type: ignore[arg-type]  # transformers types PreTrainedModel.to's wrapper as taking the model
                for name, tensor in self.model.state_dict().items():  # NaN weights decode garbage "answers"
                    check_finite(model_path, name, tensor)
        except ModelDirError as e:  # the directory, not the code: one line
            raise InputError(str(e)) from None
        self.device = device
        self.max_model_len = max_model_len or getattr(self.model.config, "max_position_embeddings", None)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        self.stop_ids = self._stop_ids()
        # answers from the preallocated-cache decoder unless told otherwise (or unsupported)
        self.static = decode != "hf" and supports_static_decode(self.model)
        if decode == "static" and not self.static:
            raise InputError("--decode static needs a Qwen3/Qwen2/Llama model with full attention only")
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self._cancel = threading.Event()  # set by cancel(): the decode in flight stops at its next step
        self.cancelled: tuple[int, int, int] | None = None  # (rows, step, steps) of the batch a cancel stopped
        self.on_batch = on_batch
        self._thread = threading.Thread(target=self._serve, name="hf-generate", daemon=True)
        self._thread.start()

    def _stop_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (getattr(self.model, "generation_config", None), self.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            ids.update(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
        return ids

    def prompt_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        return self.prompt_ids_batch([(messages, tools)])[0]

    def prompt_ids_batch(self, conversations: list[tuple[list[dict], list[dict] | None]]) -> list[list[int]]:
        """Chat-template renders (each with its tools), then one tokenizer call for the whole batch
        (it runs on all cores)."""
        extra = self.sampling.extra.get("chat_template_kwargs") or {}
        texts = [self.tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True,
                                                    **({**extra, "tools": tools} if tools else extra))
                 for m, tools in conversations]
        return self.tokenizer(texts, add_special_tokens=False)["input_ids"]

    def complete(self, messages: list[dict], tools: list[dict] | None = None, *, seed: int | None = None) -> Completion:
        """Queue one conversation for the generation thread, which renders and decodes a batch at a
        time (thousands of worker threads rendering prompts under one GIL starved the GPU)."""
        if self._closed:
            raise RegenError("the engine is closed")
        done: Future = Future()
        self._queue.put(((messages, tools), done, seed))
        return done.result()

    def _serve(self) -> None:
        from trainer.models import decoder

        while True:
            item = self._queue.get()
            if item is None or self._closed:
                if item is not None:
                    item[1].set_exception(RegenError("the engine is closed"))
                self._fail_queued()
                return
            batch = [item]
            give_up = time.monotonic() + self.max_gather_s
            while len(batch) < self.batch_size and time.monotonic() < give_up:
                try:
                    more = self._queue.get(timeout=max(0.02, min(self.gather_s, give_up - time.monotonic())))
                except queue.Empty:
                    break
                if more is None:
                    self._queue.put(None)
                    break
                batch.append(more)
            try:
                ids = self._tokenize([request for request, _, _ in batch])  # (messages, tools) each
            except Exception as e:  # noqa: BLE001 - a template error fails the batch's requests
                why = "the engine is closed" if self._closed else f"chat template failed: {type(e).__name__}: {e}"
                for _, done, _ in batch:
                    done.set_exception(RegenError(why))
                continue
            limit, fits = self.max_model_len, []
            for prompt, (_, done, seed) in zip(ids, batch):
                if limit is not None and len(prompt) + self.sampling.max_tokens > limit:
                    done.set_exception(RegenError(
                        f"prompt of {len(prompt)} tokens + max_tokens {self.sampling.max_tokens} exceeds "
                        f"the model's context length {limit}"))
                else:
                    fits.append((prompt, done, seed))
            if not fits:
                continue
            try:
                if self.on_batch is not None:
                    self.on_batch(len(fits), max(len(prompt) for prompt, _, _ in fits))
                results = self.generate([prompt for prompt, _, _ in fits], [seed for _, _, seed in fits])
            except Exception as e:  # noqa: BLE001 - every waiting request fails with it (Cancelled: closed)
                if isinstance(e, decoder.Cancelled):
                    self.cancelled = (len(fits), e.step, e.steps)
                why = "the engine is closed" if self._closed else f"generate failed: {type(e).__name__}: {e}"
                for _, done, _ in fits:
                    done.set_exception(RegenError(why))
                continue
            for (_, done, _), result in zip(fits, results):
                done.set_result(result)

    def _tokenize(self, conversations: list[tuple[list[dict], list[dict] | None]]) -> list[list[int]]:
        """prompt_ids_batch in calls of TOKENIZE_ROWS conversations, stopping between them once closed
        (rendering and tokenizing 16,384 long prompts takes seconds)."""
        from trainer.models import decoder

        ids: list[list[int]] = []
        for i in range(0, len(conversations), TOKENIZE_ROWS):
            decoder.check_cancel(self._cancel)
            ids += self.prompt_ids_batch(conversations[i:i + TOKENIZE_ROWS])
        return ids

    def _fail_queued(self) -> None:
        """Requests still queued at close fail, so the worker threads waiting on them end."""
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                item[1].set_exception(RegenError("the engine is closed"))

    def generate(self, prompts: list[list[int]], seeds: list[int | None] | None = None) -> list[Completion]:
        """Left-padded batch generation; each row's answer ends at its first stop token. Sampled by the
        static decoder, row r draws from the noise stream of its seed (`seeds`, --samples-per-prompt;
        a row without one, its index in the batch) under the engine's seed: a sample is reproduced
        in any batch. By transformers (`--decode hf`, or a model the static decoder does not run), the
        batch is seeded from its rows' seeds and the engine's seed: one generator for the whole batch,
        so a sample differs from the other samples of its prompt (another row, or another batch seed)
        but is reproduced only when it is decoded in the same batch again."""
        from trainer.generate.sampling_params import SEED_MAX
        from trainer.generate.sampling_params import Sampling as DecodeSampling
        from trainer.models import decoder

        torch, s = self.torch, self.sampling
        if self.static:  # the stand-in server sets each request's sampling
            how = DecodeSampling(temperature=s.temperature, top_p=s.top_p, seed=self.seed & SEED_MAX)
            streams = [i if x is None else x for i, x in enumerate(seeds)] if seeds else None
            rows = static_generate(self.model, prompts, s.max_tokens, self.stop_ids, cancel=self._cancel,
                                   sampling=how, streams=streams).tolist()
            return self._completions(prompts, rows)
        width = max(len(p) for p in prompts)
        input_ids = decoder.left_padded(prompts, width, self.pad_id).to(self.device)
        starts = torch.tensor([width - len(p) for p in prompts])
        attention = (torch.arange(width)[None, :] >= starts[:, None]).long().to(self.device)
        sample = s.temperature > 0
        options = dict(do_sample=True, temperature=s.temperature, top_p=s.top_p) if sample else dict(do_sample=False)
        if sample:
            key = ",".join(map(str, seeds or []))
            torch.manual_seed(sample_seed(self.seed, key, 0) if seeds and any(x is not None for x in seeds) else self.seed)
        with torch.no_grad():
            out = self.model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=s.max_tokens,
                                      eos_token_id=sorted(self.stop_ids) or None, pad_token_id=self.pad_id,
                                      use_cache=True, top_k=None,
                                      stopping_criteria=cancel_criteria(self._cancel, width, s.max_tokens),
                                      **options)
        return self._completions(prompts, out[:, width:].tolist())

    def _completions(self, prompts: list[list[int]], rows: list[list[int]]) -> list[Completion]:
        """Each row's Completion, stopping once closed (detokenizing 16,384 answers takes seconds)."""
        from trainer.models import decoder

        done = []
        for prompt, row in zip(prompts, rows):
            decoder.check_cancel(self._cancel, len(row), len(row))  # decoded whole, not yet detokenized
            done.append(self._completion(prompt, row))
        return done

    def _completion(self, prompt: list[int], row: list[int]) -> Completion:
        """A generated row cut at its first stop token (HF pads finished rows; ours keep decoding)."""
        stop = next((i for i, t in enumerate(row) if t in self.stop_ids), None)
        tokens = row if stop is None else row[:stop]
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        assert isinstance(text, str), "one row of ids decodes to one string"
        return Completion(content=text,
                          finish_reason="length" if stop is None else "stop",
                          prompt_tokens=len(prompt), completion_tokens=len(tokens) + (stop is not None),
                          token_ids=row if stop is None else row[:stop + 1])

    def cancel(self) -> None:
        """Stop at once without waiting: the batch being decoded stops at its next decode step and its
        requests fail, as do the queued ones and any later one (regen's SIGINT handler calls this)."""
        self._closed = True
        self._cancel.set()

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """cancel(), then wait for the generation thread to end (at most `wait_s`: it ends at the next
        decode step). A Ctrl-C during the wait raises here."""
        self.cancel()
        self._queue.put(None)
        self._thread.join(timeout=wait_s)
        self._fail_queued()


# ---------------------------------------------------------------------------- the run


@dataclass
class Summary:
    total: int = 0  # conversations in the input (after exact duplicates)
    skipped: int = 0  # already in the output (resume)
    done: int = 0  # regenerated and written by this run
    failed: int = 0
    truncated: int = 0  # written, with at least one turn cut at max_tokens (finish_reason length)
    tool_stops: int = 0  # written, ending at the target's first tool call ("stopped": "tool_call")
    duplicates: int = 0  # input rows repeating an earlier conversation exactly
    retries: int = 0
    repaired_bytes: int = 0  # a torn last line cut off the output before resuming
    completion_tokens: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)  # the first few distinct failures
    last_error: str | None = None
    stopped: str | None = None  # why it stopped before the end (N failures in a row)
    interrupted: bool = False  # a SIGINT stopped it (`regenerate`'s interrupt)
    agentic: bool = False  # whole trajectories (trainer_tools.agentic): the counts below are reported
    turns: int = 0  # assistant turns written
    replayed: int = 0  # tool calls answered with the trace's recorded result
    executed: int = 0  # tool calls answered by the --tool-exec executor
    tool_errors: int = 0  # executed calls whose result is an error (non-zero exit, timeout)
    diverged: int = 0  # trajectories ended at a call neither the trace nor an executor answers
    limits: dict = field(default_factory=dict)  # trajectories ended by a limit: {"max_turns": n, ...}
    rejected: int = 0  # regenerated, kept out of the output: the training template's tokens differ
    unchecked: int = 0  # assistant turns the token check could not compare (the engine gave no token ids)
    rejected_path: str | None = None

    def line(self) -> str:
        rate = self.completion_tokens / self.seconds if self.seconds else 0.0
        text = (f"regen: {self.done} regenerated, {self.skipped} already done, {self.failed} failed, "
                f"{self.truncated} truncated (finish_reason length), {self.retries} retries; "
                f"{self.completion_tokens} tokens in {self.seconds:.1f}s ({rate:.1f} tokens/s)")
        if self.tool_stops:
            text += f"; {self.tool_stops} stopped at the target's first tool call (no result to continue with)"
        if self.agentic:
            text += (f"; {self.done + self.rejected} trajectories, {self.turns} turns, {self.replayed} calls replayed, "
                     f"{self.executed} executed, {self.diverged} diverged, {self.tool_errors} tool errors")
            text += "".join(f", {n} stopped at {LIMITS[k]}" for k, n in sorted(self.limits.items()))
        if self.rejected:
            text += (f"; {self.rejected} kept out: the training template's tokens differ from the engine's "
                     f"(in {self.rejected_path})")
        if self.unchecked:
            text += f"; {self.unchecked} turns not token-checked (the engine gave no token ids)"
        if self.duplicates:
            text += f"; {self.duplicates} duplicate rows skipped"
        if self.repaired_bytes:
            text += f"; cut a torn last line ({self.repaired_bytes} bytes) off the output"
        return text


LIMITS = {"max_turns": "the turn limit (--max-turns)", "token_limit": "the token limit (--max-context-tokens)"}


@dataclass
class Regenerated:
    """One conversation done: the record, the summed completion, and what the engine produced for
    each assistant message (index, token ids or None, finish reason) for the token check."""

    record: dict
    total: Completion
    produced: list[tuple[int, list[int] | None, str]]
    unchecked: int = 0  # turns the token check could not compare


def regenerate_one(engine: Engine, prompt: Prompt, model: str) -> Regenerated:
    """Answer where the target answers (answers_after), in order, up to its first tool call."""
    history: list[dict] = []
    produced: list[tuple[int, list[int] | None, str]] = []
    finish_reasons: list[str] = []
    total = Completion(content="", finish_reason="stop")
    stopped = None
    for i, m in enumerate(prompt.messages):
        history.append(m)
        if not answers_after(prompt.messages, i):
            continue
        c = engine.complete(list(history), prompt.tools)
        answer: dict[str, Any] = {"role": "assistant", "content": c.content}
        if c.reasoning_content:
            answer["reasoning_content"] = c.reasoning_content
        if c.tool_calls:
            answer["tool_calls"] = c.tool_calls
        history.append(answer)
        produced.append((len(history) - 1, c.token_ids, c.finish_reason))
        finish_reasons.append(c.finish_reason)
        total.completion_tokens += c.completion_tokens
        total.prompt_tokens += c.prompt_tokens
        total.retries += c.retries
        if c.finish_reason == "length":
            total.finish_reason = "length"
        if c.calls_tool:
            stopped = "tool_call"
            break
    record = {"id": prompt.id, "messages": history, **({"tools": prompt.tools} if prompt.tools else {}),
              "finish_reasons": finish_reasons, "model": model, **({"stopped": stopped} if stopped else {})}
    return Regenerated(record, total, produced)


def regenerate_trajectory(engine: Engine, prompt: Prompt, model: str, agent: Agent) -> Regenerated:
    """The target's whole trajectory (trainer_tools.agentic.run_trajectory)."""
    t = run_trajectory(engine, prompt, model, agent)
    total = Completion(content="", finish_reason="length" if t.truncated else "stop",
                       completion_tokens=t.completion_tokens, retries=t.retries)
    return Regenerated(t.record, total, [(turn.message, turn.token_ids, turn.finish_reason) for turn in t.turns])


def sampled(done: Regenerated, prompt: Prompt) -> Regenerated:
    """A sample's record keyed by (prompt, sample index): `prompt_id`, `sample`, `seed` after its id."""
    if prompt.sample is not None:
        record = done.record
        done.record = {"id": record["id"], "prompt_id": prompt.id.rsplit("#", 1)[0], "sample": prompt.sample,
                       "seed": prompt.seed, **record}
    return done


def checked(done: Regenerated, checker: TokenChecker | None) -> Regenerated:
    """The record marked with its first token mismatch (`token_mismatch`), when the engine gave
    the tokens of its turns and the training template renders others."""
    produced = [(i, ids, finish) for i, ids, finish in done.produced if ids is not None]
    if checker is None:
        return done
    done.unchecked = len(done.produced) - len(produced)
    if not produced:
        return done
    mismatch = checker.check(done.record["messages"], done.record.get("tools"), produced)
    if mismatch is not None:
        done.record["token_mismatch"] = mismatch.to_json(checker.tokenizer)
    return done


class Progress:
    """A one-line bar on a terminal; on a pipe or log (a playbook step) a line every 10 s (`every_s`).
    The HF engine's batches are announced as they start decoding (`batch`), at most one line per
    `every_s` besides the first."""

    def __init__(self, total: int, stream: TextIO | None = None, every_s: float = 10.0) -> None:
        self.total = total
        # sys.stderr as it is now, not at import: an in-process caller's redirect (a log file), and
        # no stream a test's capture closed after the import
        self.stream = stream if stream is not None else sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every_s = every_s
        self.started = time.monotonic()
        self._last = 0.0
        self._last_batch = 0.0

    def update(self, s: Summary, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self._last < (0.2 if self.tty else self.every_s):
            return
        self._last = now
        finished = s.done + s.failed
        todo = self.total - s.skipped
        elapsed = now - self.started
        eta = (todo - finished) * elapsed / finished if finished else 0.0
        width = 24
        filled = int(width * finished / todo) if todo else width
        text = (f"regen [{'#' * filled}{'.' * (width - filled)}] {finished}/{todo} "
                f"failed {s.failed} truncated {s.truncated} | {s.completion_tokens / max(elapsed, 1e-9):.0f} tok/s"
                f" | eta {eta:.0f}s")
        if self.tty:
            self.stream.write("\r" + text + ("\n" if final else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def batch(self, rows: int, width: int) -> None:
        """A batch of `rows` conversations, prompts of up to `width` tokens, starts decoding (called
        from the engine's thread; on a terminal the line goes above the bar)."""
        now = time.monotonic()
        if now - self._last_batch < self.every_s:
            return
        self._last_batch = now
        text = f"regen: decoding {rows} conversations at once (prompts of up to {width} tokens)"
        self.stream.write(("\r\x1b[K" if self.tty else "") + text + "\n")
        self.stream.flush()


def regenerate(prompts: list[Prompt], engine: Engine, output: Output, *, model: str, concurrency: int = 8,
               on_progress: Callable[[Summary], None] | None = None, max_errors: int = 5,
               max_consecutive_failures: int = MAX_CONSECUTIVE_FAILURES, agent: Agent | None = None,
               checker: TokenChecker | None = None, rejected: Output | None = None,
               interrupt: threading.Event | None = None) -> Summary:
    """Regenerate every prompt not in `output.finished` (nor `rejected.finished`), `concurrency`
    conversations at a time: whole trajectories with `agent` (trainer_tools.agentic), else the
    answers after the trace's turns (regenerate_one). With `checker`, a conversation whose
    training-template tokens differ from the engine's is written to `rejected`, not `output`.

    The calling thread is the only writer. The workers are daemon threads, all started before any
    of them asks the engine: the HF engine's first batch is then (nearly) the whole of `concurrency`,
    and no thread starts while it decodes (on the CPU, -n 8192 made first batches of 1,660 to 6,435
    rows, and one of 4,444 decoded in 77 s while the other threads started, the next 3,748 in 15 s).

    Once `interrupt` is set (regen's SIGINT handler, which has cancelled the engine already) this
    stops within POLL_S: no conversation starts; with an engine that cancels (the HF engine),
    `engine.close()` waits for the batch in flight to stop at its next decode step and every answer
    a worker holds by then is written once the workers have ended (CLOSE_WAIT_S at most; a server's
    requests cannot be cancelled, so then only the answers already complete are); `s.interrupted`
    says so (the output holds whole lines only). The wait for results is polled rather than
    blocking: a SIGINT the kernel delivers to another thread (the engine's, a worker's) does not
    wake a main thread blocked in a lock, and its handler then ran only when the next answer came,
    after the whole batch in flight had decoded (tests/trainer/test_regen_interrupt.py). On Ctrl-C
    as a KeyboardInterrupt (or any error from `on_progress`) the answers already complete are
    written and this returns at once, leaving requests in flight behind. After
    `max_consecutive_failures` failures in a row (a dead server) it stops early and says so in
    `s.stopped`."""
    s = Summary(total=len(prompts), repaired_bytes=output.repaired_bytes, agentic=agent is not None,
                rejected_path=str(rejected.path) if rejected is not None else None)
    finished = output.finished | (rejected.finished if rejected is not None else set())
    todo = [p for p in prompts if p.id not in finished]
    s.skipped = len(prompts) - len(todo)
    started = time.monotonic()
    jobs: queue.Queue[Prompt] = queue.Queue()
    for p in todo:
        jobs.put(p)
    # a conversation's outcome, or None: a worker ended
    results: queue.Queue[tuple[Prompt, Regenerated | None, str | None] | None] = queue.Queue()
    stop, go = threading.Event(), threading.Event()
    interrupt = interrupt if interrupt is not None else threading.Event()

    def work() -> None:
        try:
            go.wait()
            while not stop.is_set():
                try:
                    prompt = jobs.get_nowait()
                except queue.Empty:
                    return
                try:
                    asked = engine if prompt.seed is None else Seeded(engine, prompt.seed)
                    done = regenerate_trajectory(asked, prompt, model, agent) if agent is not None \
                        else regenerate_one(asked, prompt, model)
                    results.put((prompt, checked(sampled(done, prompt), checker), None))
                except RegenError as e:
                    results.put((prompt, None, str(e)))
                except Exception as e:  # noqa: BLE001 - one bad conversation must not end the run
                    results.put((prompt, None, f"{type(e).__name__}: {e}"))
        finally:
            results.put(None)

    consecutive = 0

    def take(result: tuple[Prompt, Regenerated | None, str | None]) -> None:
        nonlocal consecutive
        prompt, answer, error = result
        if answer is None:
            _failed(s, prompt, error or "failed", max_errors)
            consecutive += 1
            return
        record, c = answer.record, answer.total
        consecutive = 0
        if "token_mismatch" in record and rejected is not None:
            rejected.append(record)
            s.rejected += 1
        else:
            output.append(record)
            s.done += 1
        s.turns += len(record["finish_reasons"])
        s.unchecked += answer.unchecked
        calls = record.get("calls") or {}
        s.replayed += calls.get("replayed", 0)
        s.executed += calls.get("executed", 0)
        s.tool_errors += calls.get("errors", 0)
        s.diverged += record.get("stopped") == "diverged"
        if record.get("stopped") in LIMITS:
            s.limits[record["stopped"]] = s.limits.get(record["stopped"], 0) + 1
        s.retries += c.retries
        s.completion_tokens += c.completion_tokens
        s.truncated += c.finish_reason == "length"
        s.tool_stops += record.get("stopped") == "tool_call"

    workers = ended = 0

    def poll() -> tuple[Prompt, Regenerated | None, str | None] | None:
        """The next answer, or None after POLL_S without one (a worker's end marker is counted)."""
        nonlocal ended
        try:
            result = results.get(timeout=POLL_S)
        except queue.Empty:
            return None
        if result is None:
            ended += 1
        return result

    try:
        for i in range(min(max(1, concurrency), len(todo))):
            if interrupt.is_set():
                break
            threading.Thread(target=work, name=f"regen-{i}", daemon=True).start()
            workers += 1
        go.set()
        left = len(todo)
        while left and not interrupt.is_set():
            result = poll()
            if result is None:
                continue
            left -= 1
            take(result)
            s.seconds = time.monotonic() - started
            if consecutive >= max_consecutive_failures:
                s.stopped = (f"stopped after {consecutive} conversations failed in a row (last: "
                             f"{s.last_error}); rerun the same command to resume")
                break
            if on_progress is not None:
                on_progress(s)
        if left and interrupt.is_set():
            s.interrupted = True
            stop.set()
            if hasattr(engine, "cancel"):  # the HF engine: its requests in flight fail at its next decode step
                engine.close()
                give_up = time.monotonic() + CLOSE_WAIT_S
                while ended < workers and time.monotonic() < give_up:  # an answer a worker holds is written too
                    result = poll()
                    if result is not None and result[1] is not None:
                        take(result)
    finally:
        stop.set()
        go.set()
        while True:  # answers that completed meanwhile are written, whatever ended the loop
            try:
                result = results.get_nowait()
            except queue.Empty:
                break
            if result is not None and result[1] is not None:
                take(result)
        s.seconds = time.monotonic() - started
    return s


def _failed(s: Summary, prompt: Prompt, message: str, max_errors: int) -> None:
    s.failed += 1
    s.last_error = message[:300]
    if len(s.errors) < max_errors:
        s.errors.append(f"{prompt.id} (input line {prompt.line}): {message}")


# ---------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer_tools.regen",
                                description="Regenerate the assistant turns of a chat JSONL with the target.")
    p.add_argument("--in", dest="inp", required=True, help="prompts JSONL (messages, ShareGPT conversations, or prompt)")
    p.add_argument("--out", required=True, help="output JSONL; a rerun skips the ids already in it")
    p.add_argument("--endpoint", action="append", default=[],
                   help="OpenAI-compatible server, e.g. http://127.0.0.1:30000 (repeat for several)")
    p.add_argument("--model", help="model name the server serves (default with --engine hf: the directory name)")
    p.add_argument("--engine", choices=["openai", "hf"], default=None,
                   help="openai (default with --endpoint) or hf: generate in this process from --model-path")
    p.add_argument("--model-path", help="local model directory for --engine hf")
    p.add_argument("--device", default="cpu", help="--engine hf: torch device (cpu, cuda:0)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp16", "fp32"], help="--engine hf: weights dtype")
    p.add_argument("--max-model-len", type=int, default=None, help="--engine hf: refuse prompts longer than this")
    p.add_argument("--decode", choices=["auto", "static", "hf"], default="auto",
                   help="--engine hf: static = greedy or sampled decoding with a preallocated KV cache, each "
                        "sample reproduced in any batch (auto: when the model has the Llama/Qwen layout); "
                        "hf = transformers' generate")
    p.add_argument("-n", "--concurrency", type=int, default=8, help="conversations in flight (hf: the batch size)")
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens per answer; longer answers count as truncated")
    p.add_argument("--temperature", type=float, default=None,
                   help=f"default: {SAMPLED_TEMPERATURE:g} with --samples-per-prompt (the recipe ablation's sampled "
                        "answers, docs/objectives.md), else 0 (greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--samples-per-prompt", type=int, default=None, metavar="N",
                   help="N answers per prompt (needs --temperature > 0), each its own row keyed by (prompt, sample "
                        "index) with its own seed; a rerun adds only the missing samples")
    p.add_argument("--seed", type=int, default=0, help="the seed the samples' seeds derive from (hf: also unsampled)")
    p.add_argument("--extra-body", default=None,
                   help='JSON object merged into each request, e.g. \'{"chat_template_kwargs": {"enable_thinking": false}}\'')
    p.add_argument("--api-key-env", default="OPENAI_API_KEY", help="environment variable holding the API key, if any")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds for a whole request (connect, send, the complete answer), each attempt")
    p.add_argument("--retries", type=int, default=3, help="retries per request on connection errors, 408/429/5xx")
    p.add_argument("--agentic", action="store_true",
                   help="whole trajectories: the target acts on its own from the trace's system and user turns; its "
                        "tool calls are answered by the trace's recorded result (same call), else --tool-exec, else "
                        "the trajectory ends there (stopped: diverged)")
    p.add_argument("--tool-exec", metavar="CMD", default=None,
                   help="--agentic: the tool executor, run once per call without a shell: a JSON array of strings "
                        "or a command line split by POSIX shell-word rules; the call {id, name, arguments} as JSON "
                        "on stdin, the result on stdout; a non-zero exit or a timeout is an error result")
    p.add_argument("--tool-timeout", type=float, default=30.0, help="--tool-exec: seconds per call")
    p.add_argument("--max-turns", type=int, default=16, help="--agentic: assistant turns per trajectory at most")
    p.add_argument("--max-context-tokens", type=int, default=32768,
                   help="--agentic: end a trajectory once a request's prompt and answer reach this many tokens")
    p.add_argument("--check-tokens", metavar="DIR", default=None,
                   help="the training tokenizer and chat template (a model directory): every conversation, rendered "
                        "by it, must hold at each assistant turn exactly the tokens the engine produced; others go "
                        "to --rejected. Default with --agentic --engine hf: --model-path; a server is asked for its "
                        "tokens (vLLM's return_token_ids) only when this is given")
    p.add_argument("--rejected", default=None,
                   help="where conversations failing the token check go (default: OUT's name with .rejected.jsonl)")
    p.add_argument("--limit", type=int, default=None, help="only the first N conversations of the input")
    p.add_argument("--max-consecutive-failures", type=int, default=MAX_CONSECUTIVE_FAILURES,
                   help="stop early after this many conversations failed in a row (a dead server)")
    p.add_argument("--progress-every", type=float, default=10.0, metavar="SECONDS",
                   help="on a pipe or log: a progress line (and a line for a batch starting to decode) at most "
                        "this often")
    return p


def json_object_arg(text: str | None, flag: str) -> dict:
    """A command-line flag's JSON object ({} when not given); InputError naming the flag otherwise."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise InputError(f"{flag}: not JSON: {e}") from None
    if not isinstance(value, dict):
        raise InputError(f"{flag} must be a JSON object")
    return value


def _sampling(args: argparse.Namespace) -> Sampling:
    extra = json_object_arg(args.extra_body, "--extra-body")
    if args.max_tokens < 1 or args.concurrency < 1 or args.max_consecutive_failures < 1:
        raise InputError("--max-tokens, --concurrency and --max-consecutive-failures must be at least 1")
    if not args.progress_every >= 0:
        raise InputError(f"--progress-every must be 0 or more seconds, got {args.progress_every:g}")
    if not args.timeout > 0 or not args.tool_timeout > 0:
        raise InputError("--timeout and --tool-timeout must be more than 0 seconds")
    if args.max_turns < 1 or args.max_context_tokens < 1:
        raise InputError("--max-turns and --max-context-tokens must be at least 1")
    if args.samples_per_prompt is not None and args.samples_per_prompt < 1:
        raise InputError(f"--samples-per-prompt must be at least 1, got {args.samples_per_prompt}")
    if args.temperature is None:
        args.temperature = SAMPLED_TEMPERATURE if args.samples_per_prompt is not None else 0.0
    if (args.samples_per_prompt or 1) > 1 and not args.temperature > 0:
        raise InputError("--samples-per-prompt above 1 needs --temperature > 0 (greedy answers to a prompt are all "
                         "the same)")
    if args.tool_exec is not None and not args.agentic:
        raise InputError("--tool-exec answers the target's own calls: it needs --agentic")
    return Sampling(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, extra=extra)


def build_engine(args: argparse.Namespace, sampling: Sampling,
                 on_batch: Callable[[int, int], None] | None = None) -> tuple[Engine, str]:
    engine = args.engine or ("openai" if args.endpoint else None)
    if engine is None:
        raise InputError("give --endpoint URL (an OpenAI-compatible server) or --engine hf --model-path DIR")
    if engine == "openai":
        if not args.endpoint or not args.model:
            raise InputError("--endpoint and --model are required for an OpenAI-compatible server")
        if args.model_path:
            raise InputError("--model-path is for --engine hf; the server already holds its model")
        return OpenAIEngine(args.endpoint, args.model, sampling, api_key=os.environ.get(args.api_key_env) or None,
                            timeout=args.timeout, retries=args.retries,
                            token_ids=args.check_tokens is not None), args.model
    if args.endpoint:
        raise InputError("--engine hf generates locally; drop --endpoint")
    if not args.model_path or not os.path.isdir(args.model_path):
        raise InputError(f"--engine hf needs --model-path DIR (a local model directory), got {args.model_path!r}")
    name = args.model or os.path.basename(os.path.normpath(args.model_path))
    return HFEngine(args.model_path, sampling, device=args.device, dtype=args.dtype, batch_size=args.concurrency,
                    max_model_len=args.max_model_len, seed=args.seed, decode=args.decode, on_batch=on_batch), name


def build_agent(args: argparse.Namespace) -> Agent | None:
    """--agentic's executor and limits (None without --agentic)."""
    if not args.agentic:
        return None
    try:
        executor = ToolExecutor(parse_tool_exec(args.tool_exec), args.tool_timeout) if args.tool_exec else None
    except ToolExecError as e:
        raise InputError(str(e)) from None
    return Agent(executor=executor, max_turns=args.max_turns, max_context_tokens=args.max_context_tokens)


def build_checker(args: argparse.Namespace, sampling: Sampling) -> TokenChecker | None:
    """The token check's training tokenizer: --check-tokens DIR, else with --agentic the HF
    engine's model (regenerating a trace's answers is checked only when asked: a random or
    undertrained model's answers often do not re-tokenize to its own tokens)."""
    where = args.check_tokens
    if where is None and args.agentic and args.engine == "hf" and args.model_path and os.path.isdir(args.model_path):
        where = args.model_path
    if where is None:
        return None
    if not os.path.isdir(where):
        raise InputError(f"--check-tokens: {where}: not a model directory")
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(where, local_files_only=True)
    except (OSError, ValueError) as e:
        raise InputError(f"--check-tokens: {where}: cannot load its tokenizer: {e}") from None
    return TokenChecker(tokenizer, sampling.extra.get("chat_template_kwargs") or {})


def rejected_path(args: argparse.Namespace) -> str:
    if args.rejected:
        return args.rejected
    out = Path(args.out)
    return str(out.with_name((out.name[:-len(".jsonl")] if out.name.endswith(".jsonl") else out.name)
                             + ".rejected.jsonl"))


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    rejected = None
    try:
        sampling = _sampling(args)
        agent = build_agent(args)
        prompts, duplicates = read_prompts(args.inp, agentic=args.agentic)
        if args.limit is not None:
            prompts = prompts[: args.limit]
        if args.samples_per_prompt is not None:
            prompts = samples(prompts, args.samples_per_prompt, args.seed)
        checker = build_checker(args, sampling)
        output = Output(args.out)
        if checker is not None:
            try:
                rejected = Output(rejected_path(args))
            except InputError:
                output.close()
                raise
    except InputError as e:
        print(f"regen: {e}", file=sys.stderr)
        return EXIT_USAGE
    engine = None
    interrupted = False
    try:
        progress = Progress(len(prompts), every_s=args.progress_every)
        try:
            engine, model = build_engine(args, sampling, on_batch=progress.batch)
        except InputError as e:
            print(f"regen: {e}", file=sys.stderr)
            return EXIT_USAGE
        done = output.finished | (rejected.finished if rejected is not None else set())
        print(f"regen: {len(prompts)} conversations, {len(done & {p.id for p in prompts})} already in "
              f"{args.out}; {args.concurrency} at a time", file=sys.stderr, flush=True)
        interrupt = threading.Event()
        try:
            with sigint_interrupts(interrupt, engine):
                summary = regenerate(prompts, engine, output, model=model, concurrency=args.concurrency,
                                     on_progress=progress.update,
                                     max_consecutive_failures=args.max_consecutive_failures, agent=agent,
                                     checker=checker, rejected=rejected, interrupt=interrupt)
            interrupted = summary.interrupted
        except KeyboardInterrupt:  # a second Ctrl-C, or one that came as a KeyboardInterrupt
            interrupted = True  # the output is closed below, then the engine cancels its batch in flight
        if interrupted:
            print(f"\nregen: interrupted{cancelled_line(engine)}; the answers that were complete are written, "
                  "the output holds whole lines only - rerun the same command to resume", file=sys.stderr, flush=True)
        else:
            summary.duplicates = duplicates
            progress.update(summary, final=True)
    finally:
        output.close()  # first: whole lines on disk, whatever happens to the engine's thread
        if rejected is not None:
            rejected.close()
        if engine is not None and not close_engine(engine):
            interrupted = True
    if interrupted:
        return 130
    if summary.stopped:
        print(f"regen: {summary.stopped}", file=sys.stderr, flush=True)
        print(summary.line(), flush=True)
        return EXIT_FAILURES
    for error in summary.errors:
        print(f"regen: failed {error}", file=sys.stderr)
    print(summary.line(), flush=True)
    return EXIT_FAILURES if summary.failed else 0


@contextlib.contextmanager
def sigint_interrupts(interrupt: threading.Event, engine: object) -> Iterator[None]:
    """While regenerating, SIGINT sets `interrupt` and cancels the engine (the HF engine's batch in
    flight stops at its next decode step) in the handler itself, whatever the main thread is doing;
    `regenerate` sees `interrupt` within POLL_S and stops. A second SIGINT raises KeyboardInterrupt
    (exit at once). Left alone where SIGINT is ignored (a background job) or off the main thread."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        yield
        return

    def on_sigint(signum: int, frame: object) -> None:
        if interrupt.is_set():
            raise KeyboardInterrupt
        interrupt.set()
        cancel = getattr(engine, "cancel", None)
        if cancel is not None:
            cancel()

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def cancelled_line(engine: Engine | None) -> str:
    """': cancelled a batch of R conversations at decode step S of N' when a cancel stopped the HF
    engine's batch in flight (how much of it the stop saved), else ''."""
    cancelled = getattr(engine, "cancelled", None)
    if not cancelled:
        return ""
    rows, step, steps = cancelled
    return f": cancelled a batch of {rows} conversations at decode step {step} of {steps}"


def close_engine(engine: Engine) -> bool:
    """engine.close() (the HF engine cancels its batch in flight and waits for its thread, seconds at
    most); False when a Ctrl-C cut the wait short: a second Ctrl-C exits at once."""
    try:
        engine.close()
    except KeyboardInterrupt:
        print("\nregen: interrupted while the engine was stopping; the output holds whole lines only",
              file=sys.stderr, flush=True)
        return False
    return True


def exit_interrupted(code: int) -> None:
    """The command line's exit after a Ctrl-C (130) skips the interpreter's shutdown: its outputs
    are closed and fsynced by then, and a daemon thread may still be inside torch or a tokenizer
    (the engine's, when a second Ctrl-C cut the wait short; a worker's token check). Python's
    shutdown ends such a thread with pthread_exit, whose unwinding through C++ frames aborts:
    exit -6, "terminate called without an active exception", in place of 130 (every time on the
    CPU with a tiny model while regen still left the batch in flight decoding at exit)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def iter_records(path: str | Path) -> Iterable[dict]:
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


if __name__ == "__main__":
    code = main(sys.argv[1:])
    if code == 130:
        exit_interrupted(code)
    sys.exit(code)
