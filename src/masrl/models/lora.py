"""Isolated-Policy: one LoRA adapter per role over one frozen, shared base model.

Every role (agent) that maps to an isolated policy owns one LoRA adapter; all adapters sit on
the same PEFT model, so the base weights are stored once. A batch may mix rows of several
roles: inside ``mixed_adapters(model, row_adapter_names)`` row ``i`` of every forward call goes
through the base plus adapter ``row_adapter_names[i]`` only. This works with autograd (training:
one forward/backward over the mixed batch, each adapter's gradient comes from its own rows
only) and under ``torch.inference_mode`` with a KV cache (batched generation: the routing holds
for the prefill and every decode step, as long as the batch size stays the same).

    model = attach_adapters(base, ["Solver", "Verifier"], r=8, alpha=16, dropout=0.0,
                            target_modules=["q_proj", "v_proj"])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])  # every adapter
    with mixed_adapters(model, [row.agent for row in rows]):
        out = model(input_ids=..., attention_mask=..., position_ids=..., use_cache=False)
    loss.backward(); opt.step()
    with base_only(model):            # reference log-probs for KL: the base, adapters off
        ref = model(...)

Routing mechanism (see docs/lora.md): while the context is open, each PEFT LoRA ``Linear``
layer's ``forward`` is replaced (instance attribute, restored on exit) by
``base(x) + index_add over adapters a of B_a(A_a(dropout_a(x[rows_a]))) * scaling_a``: each
adapter's low-rank matmuls run on its own rows only. Row indices are built once per context,
not per layer call. PEFT's own ``adapter_names=`` mixed batch refuses training mode, so it is
not used (reasons in docs/lora.md).

Do not call PEFT's ``set_adapter`` or ``disable_adapter`` on a model with several trainable
adapters: both reset ``requires_grad`` so that only the active adapter trains, and an
optimizer that holds the others then silently stops updating them. Use ``base_only`` (which
restores the flags) and ``set_all_trainable``.
"""
from __future__ import annotations

import contextlib
import warnings
from functools import partial
from typing import Iterator, Mapping, Optional, Sequence

import torch
from torch import nn

BASE = "__base__"
"""Row name (``None`` works too) for a row that goes through the base model with no adapter."""

_LORA_CONTAINERS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
_MISSING = object()


# --------------------------------------------------------------------------------------------
# building


def attach_adapters(base_model: nn.Module, adapter_names: Sequence[str], *, r: int = 8, alpha: float = 16.0,
                    dropout: float = 0.0, target_modules: Optional[Sequence[str]] = None,
                    init_lora_weights: bool | str = True, task_type: str = "CAUSAL_LM"):
    """Wrap ``base_model`` in a ``peft.PeftModel`` with one LoRA adapter per name.

    Base weights are frozen; every adapter's parameters have ``requires_grad=True`` (PEFT on its
    own makes only the active adapter trainable). All adapters share ``r``/``alpha``/``dropout``/
    ``target_modules``. With the default ``init_lora_weights=True`` ``lora_B`` is zero, so every
    adapter starts as the base model.
    """
    from peft import LoraConfig, get_peft_model

    names = list(adapter_names)
    if not names:
        raise ValueError("attach_adapters needs at least one adapter name")
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate adapter names: {names}")
    for name in names:
        if not isinstance(name, str) or not name or name == BASE or "." in name:
            raise ValueError(f"invalid adapter name {name!r}: a non-empty string without '.', not {BASE!r}")

    def config():
        return LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout,
                          target_modules=list(target_modules) if target_modules is not None else None,
                          init_lora_weights=init_lora_weights, task_type=task_type)

    with warnings.catch_warnings():  # PEFT itself reads a property that transformers 5 deprecates
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        model = get_peft_model(base_model, config(), adapter_name=names[0])
        for name in names[1:]:
            model.add_adapter(name, config())
    set_all_trainable(model)
    _lora_layers(model)  # fail now, not at the first mixed forward, on unsupported layer types
    return model


def adapter_names(model: nn.Module) -> list[str]:
    """Names of the LoRA adapters present on ``model``, in the order they were added."""
    peft_config = getattr(model, "peft_config", None)
    if isinstance(peft_config, Mapping):
        return list(peft_config.keys())
    seen: dict[str, None] = {}
    for layer in _lora_layers(model):
        for key in layer.lora_A.keys():
            seen.setdefault(key, None)
    return list(seen)


def adapter_parameters(model: nn.Module, name: Optional[str] = None) -> list[nn.Parameter]:
    """The LoRA parameters of adapter ``name`` (of every adapter when ``None``), in module order."""
    return [p for _, p in _named_adapter_params(model, name)]


def set_all_trainable(model: nn.Module) -> None:
    """``requires_grad=True`` on every adapter's parameters, ``False`` on everything else.

    Call it again after anything that runs PEFT's ``set_adapter`` / ``enable_adapter_layers``.
    """
    adapter_ids = {id(p) for p in adapter_parameters(model)}
    if not adapter_ids:
        raise ValueError("model has no LoRA adapter parameters")
    for p in model.parameters():
        p.requires_grad_(id(p) in adapter_ids)


def _named_adapter_params(model: nn.Module, name: Optional[str]) -> Iterator[tuple[str, nn.Parameter]]:
    """(PEFT state-dict key without the adapter name, parameter) for adapter ``name`` (or all)."""
    for full, p in model.named_parameters():
        parts = full.split(".")
        for i in range(1, len(parts) - 1):
            if parts[i - 1] in _LORA_CONTAINERS and (name is None or parts[i] == name):
                yield ".".join(parts[:i] + parts[i + 1:]), p
                break


def _lora_layers(model: nn.Module) -> list[nn.Module]:
    """Every PEFT LoRA layer of ``model``; raises on LoRA layer types the router cannot handle."""
    from peft.tuners.lora.layer import LoraLayer

    layers = []
    for mod_name, mod in model.named_modules():
        if not isinstance(mod, LoraLayer):
            continue
        if len(getattr(mod, "lora_embedding_A", {})):
            raise NotImplementedError(f"{mod_name}: LoRA on embeddings is not supported by the per-row router; "
                                      "target Linear layers only")
        bad = [k for k, m in mod.lora_A.items() if type(m) is not nn.Linear]
        if bad:
            raise NotImplementedError(f"{mod_name}: LoRA layer type {type(mod).__name__} (adapter {bad[0]}) "
                                      "is not supported by the per-row router; target Linear layers only")
        layers.append(mod)
    return layers


# --------------------------------------------------------------------------------------------
# per-row routing


class _Routing:
    """Row -> adapter assignment of one ``mixed_adapters`` context, with its index tensors."""

    def __init__(self, row_names: Sequence[Optional[str]], devices: set[torch.device]):
        self.n = len(row_names)
        order: dict[str, list[int]] = {}
        for i, name in enumerate(row_names):
            if name is None or name == BASE:
                continue
            order.setdefault(name, []).append(i)
        # per adapter: None (all rows), a (start, stop) contiguous range, or an index tensor per device
        self.groups: list[tuple[str, object]] = []
        with torch.inference_mode(False):  # ordinary tensors: usable both with autograd and in inference mode
            for name, rows in order.items():
                if len(rows) == self.n:
                    self.groups.append((name, None))
                elif rows[-1] - rows[0] + 1 == len(rows):
                    self.groups.append((name, (rows[0], rows[-1] + 1)))
                else:
                    cpu = torch.tensor(rows, dtype=torch.long)
                    self.groups.append((name, {d: cpu.to(d) for d in devices} | {torch.device("cpu"): cpu}))

    def index(self, where: dict, device: torch.device) -> torch.Tensor:
        idx = where.get(device)
        if idx is None:  # a layer on a device that had no LoRA weights at entry (should not happen)
            with torch.inference_mode(False):
                idx = where[device] = where[torch.device("cpu")].to(device)
        return idx


def _routed_forward(layer: nn.Module, routing: _Routing, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``base(x)`` plus, for the rows of each adapter, that adapter's LoRA delta."""
    result = layer.base_layer(x, *args, **kwargs)
    if layer.disable_adapters or not routing.groups:
        return result
    if x.shape[0] != routing.n:
        raise ValueError(f"mixed_adapters was opened for {routing.n} rows but a forward got batch size "
                         f"{x.shape[0]}; keep the batch size constant inside the context (do not drop "
                         "finished rows while decoding)")
    out_dtype = result.dtype
    for name, where in routing.groups:
        if name not in layer.lora_A:  # this layer does not carry that adapter
            continue
        lora_A, lora_B = layer.lora_A[name], layer.lora_B[name]
        drop, scaling = layer.lora_dropout[name], layer.scaling[name]
        if where is None:
            sub = x
        elif isinstance(where, tuple):
            sub = x[where[0]:where[1]]
        else:
            idx = routing.index(where, x.device)
            sub = x.index_select(0, idx)
        delta = (lora_B(lora_A(drop(sub.to(lora_A.weight.dtype)))) * scaling).to(out_dtype)
        # In place on the base output: F.linear does not save its output for backward, so autograd
        # accepts it (and would raise, not silently break, for a base layer that did).
        if where is None:
            result = result.add_(delta)
        elif isinstance(where, tuple):
            result[where[0]:where[1]].add_(delta)
        else:
            result = result.index_add_(0, idx, delta)
    return result


def _check_routable(model: nn.Module, layers: list[nn.Module], names: set[str], backward_inside: bool) -> None:
    known = set()
    for layer in layers:
        known |= set(layer.lora_A.keys())
    unknown = sorted(names - known)
    if unknown:
        raise ValueError(f"unknown adapter(s) {unknown}; the model has {sorted(known)}")
    for layer in layers:
        if layer.merged:
            raise ValueError("cannot route rows while adapters are merged into the base weights; unmerge first")
        variants = sorted(names & set(getattr(layer, "lora_variant", {}).keys()))
        if variants:
            raise NotImplementedError(f"adapter(s) {variants} use a LoRA variant (DoRA, aLoRA, ...), which the "
                                      "per-row router does not support")
    if not backward_inside and model.training and torch.is_grad_enabled() and any(
            getattr(m, "gradient_checkpointing", False) is True for m in model.modules()):
        raise NotImplementedError("mixed_adapters with gradient checkpointing: the recomputation in backward "
                                  "would run outside the routing context (wrong gradients); call backward inside "
                                  "it and pass backward_inside=True, or disable checkpointing")


@contextlib.contextmanager
def _install(layers: list[nn.Module], make_forward) -> Iterator[None]:
    saved = []
    try:
        for layer in layers:
            saved.append((layer, layer.__dict__.get("forward", _MISSING)))
            layer.forward = make_forward(layer)
        yield
    finally:
        for layer, prev in reversed(saved):
            if prev is _MISSING:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = prev


@contextlib.contextmanager
def mixed_adapters(model: nn.Module, row_adapter_names: Sequence[Optional[str]], *,
                   backward_inside: bool = False) -> Iterator[None]:
    """Inside the context, row ``i`` of every forward of ``model`` uses adapter ``row_adapter_names[i]``.

    ``None`` or ``BASE`` for a row means the base model alone. Every forward call inside must have
    ``len(row_adapter_names)`` rows (prefill and each KV-cache decode step alike). Works in train
    and eval mode, with autograd or under ``torch.inference_mode``. Contexts nest (the innermost
    wins); not thread-safe: one routing per model at a time. With gradient checkpointing the
    checkpointed layers run again in backward, so backward must run inside the context too: the
    caller says so with ``backward_inside=True`` (else checkpointing is refused in training).
    """
    names = list(row_adapter_names)
    if not names:
        raise ValueError("mixed_adapters needs at least one row")
    layers = _lora_layers(model)
    if not layers:
        raise ValueError("model has no LoRA layers")
    used = {n for n in names if n is not None and n != BASE}
    _check_routable(model, layers, used, backward_inside)
    devices = {w.device for layer in layers for w in layer.lora_A.parameters()}
    routing = _Routing(names, devices)
    with _install(layers, lambda layer: partial(_routed_forward, layer, routing)):
        yield


def route_rows(model: nn.Module, row_adapter_ids: Sequence[int]):
    """``mixed_adapters`` with integer ids into ``adapter_names(model)`` (``-1``: base model)."""
    table = adapter_names(model)
    return mixed_adapters(model, [BASE if i < 0 else table[i] for i in row_adapter_ids])


@contextlib.contextmanager
def base_only(model: nn.Module) -> Iterator[None]:
    """The base model with every adapter off (reference log-probs for KL).

    Uses PEFT's ``disable_adapter`` and then restores every parameter's ``requires_grad``, which
    PEFT resets on exit (it would leave only the active adapter trainable). Also overrides an
    enclosing ``mixed_adapters`` context.
    """
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        with model.disable_adapter():
            yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


# --------------------------------------------------------------------------------------------
# checkpoints


def adapter_state_dict(model: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """Adapter ``name`` as a plain ``{key: tensor}`` dict (CPU, contiguous, no shared storage).

    Keys are PEFT's saved-adapter keys (adapter name removed), e.g.
    ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``, so the dict can go
    straight to ``safetensors.torch.save_file``.
    """
    out = {key: p.detach().to("cpu", copy=True).contiguous() for key, p in _named_adapter_params(model, name)}
    if not out:
        raise KeyError(f"no adapter {name!r}; the model has {adapter_names(model)}")
    return out


def load_adapter_state_dict(model: nn.Module, name: str, tensors: Mapping[str, torch.Tensor]) -> None:
    """Copy ``tensors`` (from ``adapter_state_dict``) into adapter ``name`` in place.

    Strict: the keys and shapes must match exactly. Parameters keep their identity, so an
    optimizer that holds them stays valid.
    """
    params = dict(_named_adapter_params(model, name))
    if not params:
        raise KeyError(f"no adapter {name!r}; the model has {adapter_names(model)}")
    missing, unexpected = sorted(set(params) - set(tensors)), sorted(set(tensors) - set(params))
    if missing or unexpected:
        raise KeyError(f"adapter {name!r} state dict mismatch: missing {missing[:3]}{'...' if len(missing) > 3 else ''}"
                       f", unexpected {unexpected[:3]}{'...' if len(unexpected) > 3 else ''}")
    for key, p in params.items():
        if tuple(tensors[key].shape) != tuple(p.shape):
            raise ValueError(f"{key}: shape {tuple(tensors[key].shape)} != {tuple(p.shape)}")
    with torch.no_grad():
        for key, p in params.items():
            p.copy_(tensors[key].to(device=p.device, dtype=p.dtype))


def load_adapter_folders(model: nn.Module, folder: str) -> None:
    """Start every adapter of ``model`` from ``folder/<adapter>/adapter_model.safetensors`` (PEFT folders,
    as ``masrl export`` writes them); the rank and target modules must match (a clear error otherwise)."""
    from pathlib import Path

    from safetensors.torch import load_file

    root = Path(folder).expanduser()
    for name in adapter_names(model):
        path = root / name / "adapter_model.safetensors"
        if not path.is_file():
            found = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
            raise FileNotFoundError(f"lora.init_from: no adapter {name!r} ({path} missing); "
                                    f"adapter folders there: {found or 'none'}")
        try:
            load_adapter_state_dict(model, name, load_file(str(path)))
        except (KeyError, ValueError) as e:
            raise ValueError(f"lora.init_from: {path} does not fit the policy's LoRA settings "
                             f"(r, target_modules): {str(e).strip(chr(39))}") from None
