"""Model shapes for the memory plan: from the tiny config, a local/hub config.json, or a known table."""
from __future__ import annotations

from dataclasses import dataclass

# Published config.json values, for planning without downloading the model (hub id -> fields).
KNOWN = {
    "qwen/qwen3-8b": dict(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, intermediate_size=12288, vocab_size=151936, tie_word_embeddings=False,
                          qk_norm=True),
    "qwen/qwen3-4b": dict(hidden_size=2560, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                          head_dim=128, intermediate_size=9728, vocab_size=151936, tie_word_embeddings=True,
                          qk_norm=True),
    "qwen/qwen2.5-7b": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                            intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False, qkv_bias=True),
    "qwen/qwen2.5-7b-instruct": dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                                     num_key_value_heads=4, intermediate_size=18944, vocab_size=152064,
                                     tie_word_embeddings=False, qkv_bias=True),
    "qwen/qwen2.5-3b-instruct": dict(hidden_size=2048, num_hidden_layers=36, num_attention_heads=16,
                                     num_key_value_heads=2, intermediate_size=11008, vocab_size=151936,
                                     tie_word_embeddings=True, qkv_bias=True),
}


@dataclass
class ModelShape:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    qk_norm: bool = False

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        q = self.heads * self.head_dim
        attn = self.hidden * (q + 2 * self.kv_dim) + q * self.hidden
        attn += (q + 2 * self.kv_dim) if self.qkv_bias else 0
        attn += 2 * self.head_dim if self.qk_norm else 0
        return attn + 3 * self.hidden * self.intermediate + 2 * self.hidden

    @property
    def root_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.root_params


def shape_from_fields(name: str, f: dict) -> ModelShape:
    heads = f["num_attention_heads"]
    return ModelShape(name, f["hidden_size"], f["num_hidden_layers"], heads, f.get("num_key_value_heads") or heads,
                      f.get("head_dim") or f["hidden_size"] // heads, f["intermediate_size"], f["vocab_size"],
                      bool(f.get("tie_word_embeddings", False)), bool(f.get("qkv_bias", f.get("attention_bias"))),
                      bool(f.get("qk_norm")))


def model_shape(pcfg) -> ModelShape:
    """The shape of a policy's model without loading its weights."""
    if pcfg.model == "tiny":
        from masrl.models.tiny import TINY_DEFAULTS, build_char_tokenizer

        fields = {**TINY_DEFAULTS, **pcfg.tiny, "vocab_size": len(build_char_tokenizer())}
        return shape_from_fields("tiny", fields)
    known = KNOWN.get(str(pcfg.model).lower())
    if known is not None:
        return shape_from_fields(str(pcfg.model), known)
    from transformers import AutoConfig

    from masrl.models.hub import resolve_model_source

    try:
        config = AutoConfig.from_pretrained(resolve_model_source(pcfg.model), trust_remote_code=pcfg.trust_remote_code)
    except OSError as e:
        raise ValueError(f"masrl plan: no config.json for model {pcfg.model!r} ({e}); download it or use one of "
                         f"{sorted(KNOWN)}") from None
    fields = config.to_dict()
    fields.setdefault("qkv_bias", getattr(config, "model_type", "") == "qwen2")
    fields.setdefault("qk_norm", getattr(config, "model_type", "") == "qwen3")
    return shape_from_fields(str(pcfg.model), fields)
