"""The hub-format fixture directory loads through the plain transformers Auto* route."""

import json

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

CONV = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 7 times 6?"},
        {"role": "assistant", "content": "<think>\nmultiply 7 by 6\n</think>\n\n42."},
        {"role": "user", "content": "And 12 plus 30?"},
        {"role": "assistant", "content": "Also 42."}]


def test_qwen3_directory_has_the_hub_layout_and_loads(qwen3_model_dir):
    d = qwen3_model_dir
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and all((d / s).exists() for s in shards)
    names = set()
    for s in shards:
        with safe_open(str(d / s), "pt") as f:
            names |= set(f.keys())
    assert names == set(index["weight_map"])
    model = AutoModelForCausalLM.from_pretrained(d, local_files_only=True)
    assert type(model).__name__ == "Qwen3ForCausalLM" and model.dtype == torch.bfloat16
    assert set(model.state_dict()) == names  # nothing missing, nothing unexpected
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    config = AutoConfig.from_pretrained(d, local_files_only=True)
    assert config.vocab_size > len(tok)  # padded rows, as Qwen3 (151936 > 151669)
    gen = GenerationConfig.from_pretrained(d, local_files_only=True)
    assert tok.convert_tokens_to_ids("<|im_end|>") in gen.eos_token_id
    for special in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|endoftext|>"):
        assert tok.tokenize(f"a{special}b")[1] == special  # one token each
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"


def test_qwen3_template_thinking_on_and_off(qwen3_model_dir):
    tok = AutoTokenizer.from_pretrained(qwen3_model_dir, local_files_only=True)
    text = tok.apply_chat_template(CONV, tokenize=False)
    # history loses its reasoning; the final turn always carries a (here empty) think block
    assert "multiply" not in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nAlso 42.<|im_end|>\n")
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    last = tok.apply_chat_template(CONV[:3], tokenize=False)
    assert last.endswith("<|im_start|>assistant\n<think>\nmultiply 7 by 6\n</think>\n\n42.<|im_end|>\n")
    on = tok.apply_chat_template(CONV[:2], tokenize=False, add_generation_prompt=True)
    off = tok.apply_chat_template(CONV[:2], tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert on.endswith("<|im_start|>assistant\n")
    assert off == on + "<think>\n\n</think>\n\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text  # byte-level: lossless


def test_llama3_directory_loads_with_its_own_template(llama3_model_dir):
    d = llama3_model_dir
    model = AutoModelForCausalLM.from_pretrained(d, local_files_only=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    tok = AutoTokenizer.from_pretrained(d, local_files_only=True)
    assert tok.pad_token is None and tok.eos_token == "<|eot_id|>"  # as Llama 3 ships
    text = tok.apply_chat_template(CONV[:2], tokenize=False, add_generation_prompt=True)
    assert text == ("<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
                    "<|start_header_id|>user<|end_header_id|>\n\nWhat is 7 times 6?<|eot_id|>"
                    "<|start_header_id|>assistant<|end_header_id|>\n\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|begin_of_text|>")
