"""Tiny causal LMs built from a config, with a character-level tokenizer: CPU tests and quickstarts.

The tokenizer is a real ``transformers.PreTrainedTokenizerFast`` (WordLevel over single
characters, plus whole-word tokens for the tags that workflows use) with a chat template,
so tiny models go through exactly the code paths that hub models do.
"""
from __future__ import annotations

from typing import Any

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from masrl.errors import ConfigError

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
# multi-character tokens: the tags and verdicts workflows emit, so tiny models need fewer steps
WORD_TOKENS = [
    "\\boxed{", "<verify>", "</verify>", "approve", "reject", "<search>", "</search>",
    "<information>", "</information>", "<answer>", "</answer>", "Correct", "Incorrect",
    "SUBTASK",
]
# one user message rendered as its content; assistant content follows directly
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] + '\n' }}"
    "{% elif message['role'] == 'user' %}{{ message['content'] }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)


def build_char_tokenizer(extra_tokens: list[str] | None = None) -> PreTrainedTokenizerFast:
    """Printable ASCII + newline, one token each, plus ``WORD_TOKENS`` and ``extra_tokens``."""
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    words = WORD_TOKENS + [t for t in (extra_tokens or []) if t not in WORD_TOKENS]
    vocab: dict[str, int] = {}
    for tok in SPECIAL_TOKENS + words + chars:
        vocab.setdefault(tok, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>",
                                  eos_token="</s>", unk_token="<unk>", padding_side="left")
    tok.add_tokens(words)  # matched before the per-character split
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


TINY_DEFAULTS: dict[str, Any] = {
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "intermediate_size": 384,
    "max_position_embeddings": 512,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}


def build_tiny_model(tokenizer: PreTrainedTokenizerFast, overrides: dict[str, Any] | None = None,
                     seed: int = 0) -> LlamaForCausalLM:
    """A small Llama-architecture model sized by ``TINY_DEFAULTS`` updated with ``overrides``."""
    import torch

    params = {**TINY_DEFAULTS, **(overrides or {})}
    unknown = sorted(set(params) - set(LlamaConfig().to_dict()) - {"rope_theta"})
    if unknown:
        raise ConfigError(f"unknown tiny model config keys {unknown}; see transformers.LlamaConfig")
    sizes = [k for k, v in TINY_DEFAULTS.items() if type(v) is int]
    wrong = {k: params[k] for k in sizes if type(params[k]) is not int or params[k] < 1}
    if wrong:
        raise ConfigError(f"tiny model config: {wrong} must be positive integers")
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        config = LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                             bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                             **params)
        model = LlamaForCausalLM(config)
    except Exception as e:  # noqa: BLE001 - transformers' own checks (heads that do not divide the width, ...)
        raise ConfigError(f"tiny model config {overrides or {}}: {str(e).strip().splitlines()[-1].strip()}") from None
    finally:
        torch.random.set_rng_state(state)
    return model
