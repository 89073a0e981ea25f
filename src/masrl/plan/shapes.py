"""Model shapes for the memory plan: from the tiny config, a local/hub config.json, or a known table."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from masrl.argtypes import shown
from masrl.errors import ConfigError, read_user_text

# Published config.json values, for planning without downloading the model (hub id -> fields).
_QWEN25 = dict(tie_word_embeddings=True, qkv_bias=True, vocab_size=151936)
_QWEN25_0_5B = dict(_QWEN25, hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                    intermediate_size=4864)
_QWEN25_1_5B = dict(_QWEN25, hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                    intermediate_size=8960)
_QWEN25_3B = dict(_QWEN25, hidden_size=2048, num_hidden_layers=36, num_attention_heads=16, num_key_value_heads=2,
                  intermediate_size=11008)
_QWEN25_7B = dict(hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                  intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False, qkv_bias=True)
_QWEN3 = dict(head_dim=128, num_key_value_heads=8, vocab_size=151936, qk_norm=True)
_SMOLLM2_135M = dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                     intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True)
KNOWN = {
    "Qwen/Qwen2.5-0.5B": _QWEN25_0_5B, "Qwen/Qwen2.5-0.5B-Instruct": _QWEN25_0_5B,
    "Qwen/Qwen2.5-1.5B": _QWEN25_1_5B, "Qwen/Qwen2.5-1.5B-Instruct": _QWEN25_1_5B,
    "Qwen/Qwen2.5-3B": _QWEN25_3B, "Qwen/Qwen2.5-3B-Instruct": _QWEN25_3B,
    "Qwen/Qwen2.5-7B": _QWEN25_7B, "Qwen/Qwen2.5-7B-Instruct": _QWEN25_7B,
    "Qwen/Qwen3-0.6B": dict(_QWEN3, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                            intermediate_size=3072, tie_word_embeddings=True),
    "Qwen/Qwen3-1.7B": dict(_QWEN3, hidden_size=2048, num_hidden_layers=28, num_attention_heads=16,
                            intermediate_size=6144, tie_word_embeddings=True),
    "Qwen/Qwen3-4B": dict(_QWEN3, hidden_size=2560, num_hidden_layers=36, num_attention_heads=32,
                          intermediate_size=9728, tie_word_embeddings=True),
    "Qwen/Qwen3-8B": dict(_QWEN3, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                          intermediate_size=12288, tie_word_embeddings=False),
    "HuggingFaceTB/SmolLM2-135M-Instruct": _SMOLLM2_135M,
    "smollm2-135m-instruct": _SMOLLM2_135M,  # masrl's alias (models.hub.ALIASES): the same architecture
}
_BY_ID = {model_id.lower(): fields for model_id, fields in KNOWN.items()}  # ids are case-insensitive
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
MAX_DIM = 2 ** 24  # no published decoder comes near 16.7M in any of its dimensions
MAX_CONFIG_BYTES = 1 << 20
HUB_TIMEOUT_S = 10


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


def _dim(f: dict, key: str, source: str) -> int:
    value = f.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_DIM:
        raise ConfigError(f"{source}: {key} must be an integer in 1..{MAX_DIM:,}, got {shown(value)}")
    return value


def shape_from_fields(name: str, f: dict, source: str | None = None) -> ModelShape:
    """The shape of ``f`` (config.json fields), every value checked: positive integers, heads dividing the
    hidden size (unless head_dim is given), kv heads dividing heads. ``source`` names where ``f`` came from."""
    source = source or f"model {name}"
    for key in REQUIRED:
        if key not in f:
            raise ConfigError(f"{source}: no {key!r} (a decoder's config.json has {', '.join(REQUIRED)})")
    hidden, layers, heads, inter, vocab = (_dim(f, key, source) for key in REQUIRED)
    kv_heads = _dim(f, "num_key_value_heads", source) if f.get("num_key_value_heads") is not None else heads
    if f.get("head_dim") is not None:
        head_dim = _dim(f, "head_dim", source)
    elif hidden % heads:
        raise ConfigError(f"{source}: num_attention_heads {heads} does not divide hidden_size {hidden}")
    else:
        head_dim = hidden // heads
    if heads % kv_heads:
        raise ConfigError(f"{source}: num_key_value_heads {kv_heads} does not divide num_attention_heads {heads}")
    return ModelShape(name, hidden, layers, heads, kv_heads, head_dim, inter, vocab,
                      bool(f.get("tie_word_embeddings", False)), bool(f.get("qkv_bias", f.get("attention_bias"))),
                      bool(f.get("qk_norm")))


def read_model_config(path: str | Path, what: str = "--model-config") -> dict:
    """The fields of a config.json (``path``, or ``path/config.json`` for a model folder), one error line
    for a file that is missing, too large, not JSON or not an object."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    return parse_model_config(read_user_text(path, what, max_bytes=MAX_CONFIG_BYTES), f"{what} {path}")


def parse_model_config(text: str, where: str) -> dict:
    try:
        fields = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise ConfigError(f"{where}: not JSON ({shown(e, 120)})") from None
    if not isinstance(fields, dict):
        raise ConfigError(f"{where}: not a JSON object (a model's config.json)")
    _derived_flags(fields)
    return fields


def _derived_flags(fields: dict) -> None:
    fields.setdefault("qkv_bias", fields.get("attention_bias", fields.get("model_type") == "qwen2"))
    fields.setdefault("qk_norm", fields.get("model_type") == "qwen3")


def model_shape(pcfg, model_config: str | Path | None = None, policy: str = "") -> ModelShape:
    """The shape of a policy's model without loading its weights: from ``model_config`` (a config.json),
    the tiny config, the table of published shapes, or the model's own config.json (a local folder, or
    the hub when it can be reached)."""
    where = f"policy {policy} ({pcfg.model})" if policy else f"model {pcfg.model}"
    if model_config is not None:
        return shape_from_fields(str(pcfg.model), read_model_config(model_config), f"--model-config {model_config}")
    if pcfg.model == "tiny":
        from masrl.models.tiny import TINY_DEFAULTS, build_char_tokenizer

        fields = {**TINY_DEFAULTS, **pcfg.tiny, "vocab_size": len(build_char_tokenizer())}
        return shape_from_fields("tiny", fields, f"policy {policy} tiny model" if policy else "tiny model")
    known = _BY_ID.get(str(pcfg.model).lower())
    if known is not None:
        return shape_from_fields(str(pcfg.model), known, where)
    return shape_from_fields(str(pcfg.model), _hub_fields(pcfg, where), where)


def _hub_fields(pcfg, where: str) -> dict:
    """config.json of a local model folder, of the Hugging Face cache, or of the hub (one request, no retries:
    offline, the plan says so at once)."""
    from masrl.models.hub import resolve_model_source

    source = resolve_model_source(pcfg.model)
    if Path(source).is_dir():
        return read_model_config(source, f"{where}: config.json")
    import huggingface_hub

    cached = huggingface_hub.try_to_load_from_cache(source, "config.json")
    if isinstance(cached, str):
        return read_model_config(cached, f"{where}: cached config.json")
    url = huggingface_hub.hf_hub_url(source, "config.json")
    try:
        response = huggingface_hub.get_session().get(url, headers=huggingface_hub.utils.build_hf_headers(),
                                                     timeout=HUB_TIMEOUT_S, follow_redirects=True)
        response.raise_for_status()
        text = response.text[:MAX_CONFIG_BYTES]
    except Exception as e:  # noqa: BLE001 — offline, no such repository, a gated model: reported, not hidden
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"masrl plan: {where}: not a model known offline and its config.json is not at hand "
                          f"({shown(reason, 80)}); pass --model-config PATH (the model's config.json) or use one "
                          f"of {', '.join(KNOWN)}") from None
    return parse_model_config(text, f"{where}: {url}")
