"""Write a model directory the way the Hugging Face hub ships one, without downloading anything.

    write_hub_model(dir)                      # tiny Qwen3 target, Qwen3 chat template
    write_hub_model(dir, family="llama3")     # tiny Llama target, Llama-3 chat template
    write_hub_model(dir, dims=QWEN3_8B_DIMS, device="cuda")   # 8B-shaped random weights

The directory holds what a user's `/models/Qwen3-8B` holds: `config.json` (in the hub's
transformers-4.5x style), sharded `model-0000N-of-0000M.safetensors` with
`model.safetensors.index.json`, `generation_config.json`, and `tokenizer.json` +
`tokenizer_config.json` (plus `vocab.json`/`merges.txt` for Qwen) of a byte-level BPE
tokenizer trained here with the `tokenizers` library. Special tokens are added after the BPE
vocabulary, as on the hub, and the config's vocab_size is padded beyond the tokenizer (Qwen3:
151936 rows for 151669 tokens), so the first unused row can serve as the DFlash mask token.

Weights are written tensor by tensor from parameter shapes (never a whole model in memory),
so the same code writes a 16 GB 8B-shaped directory on a GPU host.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from trainer.export import built_beside
from trainer.testing.chat_templates import LLAMA3, QWEN3

QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")

# (token, special) in the hub's order; Qwen3 marks <think>/<tool_call> as added but not special.
QWEN3_ADDED = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
               ("<tool_call>", False), ("</tool_call>", False), ("<tool_response>", False),
               ("</tool_response>", False), ("<think>", False), ("</think>", False)]
LLAMA3_ADDED = [("<|begin_of_text|>", True), ("<|end_of_text|>", True), ("<|start_header_id|>", True),
                ("<|end_header_id|>", True), ("<|eom_id|>", True), ("<|eot_id|>", True)]

QWEN3_8B_DIMS = dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936)
TINY_DIMS = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=16, intermediate_size=128)

CORPUS = """\
The quick brown fox jumps over the lazy dog. A speculative decoder drafts a block of tokens and the target verifies them.
Training a drafter needs the target's hidden states; the drafter learns to predict what the target would say next.
Question: what is 12 plus 30? Answer: 12 plus 30 is 42. Question: what is 7 times 6? Answer: 42.
def add(a, b):
    return a + b
print(add(2, 3))  # prints 5
Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of Italy.
Let me think step by step. First, read the question carefully. Then write the answer clearly and briefly.
Sure! Here is a short poem about the sea: waves roll in, waves roll out, the gulls cry and the wind turns about.
The user asked for a list: 1. apples 2. oranges 3. pears. The assistant replied with the list sorted by name.
JSON looks like {"name": "value", "count": 3, "items": [1, 2, 3]} and YAML looks like name: value.
Hello, how are you today? I am fine, thank you. Can you help me with my homework? Of course, what is it?
The model directory holds config.json, tokenizer.json and safetensors shards with an index file.
"""


# ---------------------------------------------------------------------------- tokenizer


def train_tokenizer(family: str = "qwen3", corpus: str | Iterable[str] = CORPUS, vocab_size: int = 512) -> Tokenizer:
    """A byte-level BPE trained on `corpus`, with the family's pre-tokenizer and added tokens."""
    split, added = (QWEN_SPLIT, QWEN3_ADDED) if family == "qwen3" else (LLAMA3_SPLIT, LLAMA3_ADDED)
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    if family == "qwen3":
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    lines = corpus.splitlines() if isinstance(corpus, str) else list(corpus)
    lines += [QWEN3 if family == "qwen3" else LLAMA3]
    tok.train_from_iterator(lines, trainer=trainer)
    for content, special in added:
        token = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        if special:
            tok.add_special_tokens([token])
        else:
            tok.add_tokens([token])
    return tok


def _added_tokens_decoder(tok: Tokenizer) -> dict:
    return {str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                     "single_word": t.single_word, "special": t.special}
            for i, t in sorted(tok.get_added_tokens_decoder().items())}


def tokenizer_config(family: str, tok: Tokenizer) -> dict:
    common = {"added_tokens_decoder": _added_tokens_decoder(tok), "clean_up_tokenization_spaces": False,
              "model_max_length": 131072}
    if family == "qwen3":
        return {"add_bos_token": False, "add_prefix_space": False, **common,
                "additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "bos_token": None,
                "chat_template": QWEN3, "eos_token": "<|im_end|>", "errors": "replace",
                "pad_token": "<|endoftext|>", "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
                "unk_token": None}
    # Llama 3 ships no pad token; the trainer must cope.
    return {**common, "bos_token": "<|begin_of_text|>", "chat_template": LLAMA3, "eos_token": "<|eot_id|>",
            "model_input_names": ["input_ids", "attention_mask"], "tokenizer_class": "PreTrainedTokenizerFast"}


# ---------------------------------------------------------------------------- configs


def model_config(family: str, dims: dict, tok: Tokenizer, dtype: str) -> dict:
    """config.json as the hub has it (transformers 4.5x style: torch_dtype, top-level rope_theta)."""
    ids = tok.get_vocab()
    vocab = dims.get("vocab_size") or -(-(tok.get_vocab_size() + 8) // 64) * 64
    shape = {k: v for k, v in dims.items() if k != "vocab_size"}
    if family == "qwen3":
        return {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"], "hidden_act": "silu",
                "initializer_range": 0.02, "max_position_embeddings": 40960,
                "max_window_layers": shape["num_hidden_layers"], "model_type": "qwen3", "rms_norm_eps": 1e-06,
                "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None, "tie_word_embeddings": False,
                "torch_dtype": dtype, "transformers_version": "4.51.0", "use_cache": True,
                "use_sliding_window": False, "vocab_size": vocab, **shape}
    return {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
            "bos_token_id": ids["<|begin_of_text|>"], "eos_token_id": ids["<|end_of_text|>"], "hidden_act": "silu",
            "initializer_range": 0.02, "max_position_embeddings": 8192, "mlp_bias": False, "model_type": "llama",
            "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0,
            "tie_word_embeddings": False, "torch_dtype": dtype, "transformers_version": "4.40.0.dev0",
            "use_cache": True, "vocab_size": vocab, **shape}


def generation_config(family: str, tok: Tokenizer) -> dict:
    ids = tok.get_vocab()
    if family == "qwen3":
        return {"bos_token_id": ids["<|endoftext|>"], "do_sample": True,
                "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]], "pad_token_id": ids["<|endoftext|>"],
                "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0"}
    return {"bos_token_id": ids["<|begin_of_text|>"], "do_sample": True,
            "eos_token_id": [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]],
            "temperature": 0.6, "top_p": 0.9, "transformers_version": "4.40.0.dev0"}


# ---------------------------------------------------------------------------- weights


def parameter_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of the config's architecture (built on the meta device)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(**{k: v for k, v in config.items() if k not in ("architectures", "torch_dtype",
                                                                                "transformers_version")})
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator, device: str,
                  dtype: torch.dtype, std: float = 0.02) -> torch.Tensor:
    """Norm weights 1, everything else N(0, std): the initialisation HF models use."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    return (torch.randn(shape, generator=generator, device=device, dtype=torch.float32) * std).to(dtype)


def write_sharded(out: Path, shapes: dict[str, tuple[int, ...]], make: Callable[[str], torch.Tensor],
                  dtype: torch.dtype, max_shard_bytes: int) -> list[str]:
    """model-0000N-of-0000M.safetensors + model.safetensors.index.json; one shard in memory at a time."""
    size = torch.tensor([], dtype=dtype).element_size()
    shards: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        n = size * int(torch.Size(shape).numel())
        if shards[-1] and used + n > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += n
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total = {}, 0
    for names, file in zip(shards, files):
        tensors = {name: make(name).to("cpu").contiguous() for name in names}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in names})
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return files


# ---------------------------------------------------------------------------- the directory


def write_hub_model(
    out_dir: str | Path,
    family: str = "qwen3",
    dims: dict | None = None,
    *,
    seed: int = 0,
    dtype: str = "bfloat16",
    shards: int | None = 2,
    max_shard_bytes: int | None = None,
    device: str = "cpu",
    corpus: str | Iterable[str] = CORPUS,
    tokenizer_vocab: int = 512,
    state_dict: dict[str, torch.Tensor] | None = None,
    tokenizer: Tokenizer | None = None,
) -> Path:
    """Write a hub-format model directory at out_dir (built beside it, then renamed into place).

    family: "qwen3" (Qwen3ForCausalLM, Qwen3 template) or "llama3" (LlamaForCausalLM, Llama-3
    template). dims: architecture sizes (TINY_DIMS by default; QWEN3_8B_DIMS for the 8B shape;
    vocab_size defaults to the tokenizer's size padded to a multiple of 64). Weights are random
    (seeded) unless `state_dict` gives them (e.g. a model fitted on data, see `fit_hub_model`).
    shards: split into about this many files; or max_shard_bytes per file (the hub uses 5 GB).
    tokenizer: a tokenizer already trained with `train_tokenizer` (the one `state_dict` was
    trained with); default: one trained here on `corpus`.
    """
    if family not in ("qwen3", "llama3"):
        raise ValueError(f"family must be qwen3 or llama3, got {family!r}")
    out = Path(out_dir)
    with built_beside(out) as tmp:
        tok = tokenizer if tokenizer is not None else train_tokenizer(family, corpus, tokenizer_vocab)
        tok.save(str(tmp / "tokenizer.json"))
        if family == "qwen3":
            tok.model.save(str(tmp))  # vocab.json + merges.txt, as Qwen ships them
        (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(family, tok), indent=2) + "\n")
        if family == "llama3":
            (tmp / "special_tokens_map.json").write_text(json.dumps(
                {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, indent=2) + "\n")
        config = model_config(family, {**TINY_DIMS, **(dims or {})}, tok, dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(generation_config(family, tok), indent=2) + "\n")
        torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
        shapes = parameter_shapes(config)
        if max_shard_bytes is None:
            total = sum(int(torch.Size(s).numel()) for s in shapes.values()) * torch_dtype.itemsize
            max_shard_bytes = -(-total // max(shards or 1, 1))
        generator = torch.Generator(device=device).manual_seed(seed)

        def make(name: str) -> torch.Tensor:
            if state_dict is not None:
                return state_dict[name].to(torch_dtype)
            return random_tensor(name, shapes[name], generator, device, torch_dtype)

        write_sharded(tmp, shapes, make, torch_dtype, max_shard_bytes)
    return out


def fit_hub_model(model_dir: str | Path, conversations: list[dict], steps: int = 200, lr: float = 3e-3,
                  seed: int = 0) -> Path:
    """Train the (tiny) model in model_dir as a language model on chat-rendered conversations and
    rewrite its weights in place (same shards), so its greedy answers follow the data."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    texts = [tok.apply_chat_template(c["messages"], tokenize=False) for c in conversations]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    torch.manual_seed(seed)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    for step in range(steps):
        rows = [ids[(step * 8 + j) % len(ids)] for j in range(8)]
        length = max(len(r) for r in rows)
        x = torch.full((len(rows), length), pad)
        attn = torch.zeros_like(x)
        for i, r in enumerate(rows):
            x[i, : len(r)] = torch.tensor(r)
            attn[i, : len(r)] = 1
        loss = model(input_ids=x, attention_mask=attn, labels=x.masked_fill(attn == 0, -100)).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    config = json.loads((model_dir / "config.json").read_text())
    state = {k: v.detach() for k, v in model.state_dict().items()}
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    torch_dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[config["torch_dtype"]]
    by_file: dict[str, dict[str, torch.Tensor]] = {}
    for name, file in index["weight_map"].items():
        by_file.setdefault(file, {})[name] = state[name].to(torch_dtype).contiguous()
    for file, tensors in by_file.items():
        tmp = model_dir / f".{file}.tmp"
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, model_dir / file)
    return model_dir
