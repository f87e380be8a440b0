"""A word-level tokenizer with a Qwen-like chat template, built in code (no download)."""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|MASK|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def synthetic_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """Specials first (pad 0, im_start 1, im_end 2, mask 3), then roles, then `words`."""
    vocab_words = SPECIALS + ["<unk>", "system", "user", "assistant"] + [w for w in words]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(vocab_words))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        unk_token="<unk>",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        mask_token="<|MASK|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
