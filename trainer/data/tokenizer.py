"""A word-level tokenizer with a Qwen-like chat template, built in code (no download)."""

from __future__ import annotations

from typing import Any

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from trainer.data.synth import synthetic_words
from trainer.run.config import TrainerConfig

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


def build_tokenizer(cfg: TrainerConfig) -> Any:
    """The target's tokenizer (model.target.path), else the synthetic word-level one. Here, not beside
    the model builders, so that what needs only the tokenizer (data-report, plan --data) does not
    import torch and the model code (3 CPU-seconds a process)."""
    if cfg.model.target.path is not None:
        from transformers import AutoTokenizer

        from trainer.run.family import check_model_dir

        check_model_dir(cfg.model.target.path, weights=False)  # one line where transformers reads a hub repo id
        return AutoTokenizer.from_pretrained(cfg.model.target.path, local_files_only=True)
    return synthetic_tokenizer(synthetic_words())
