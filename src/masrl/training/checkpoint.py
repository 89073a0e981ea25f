"""Checkpoints: safetensors weights and optimizer state, JSON trainer state, a checksummed manifest.

A checkpoint is written to a temporary folder and renamed into place, so a crash leaves
either the old set of checkpoints or the new one. Loading verifies every file against the
manifest's sha256; a corrupt or partial checkpoint is skipped (with a warning) in favour of
the previous one. No pickles: everything is safetensors or JSON.

A policy's folder holds one of two formats:
- consolidated (the local runtime, the replica strategy): ``model.safetensors`` (whole tensors),
  ``optimizer.safetensors`` + ``optimizer.json`` (``optimizer_to_tensors``: state keyed by index);
- sharded (``runtime.strategy: fsdp``): ``dcp/``, written by ``torch.distributed.checkpoint`` with
  every rank saving its own shards (safetensors files through DCP's Hugging Face storage writer,
  whose headers carry the shard offsets: no pickled metadata), keys ``model.<param>`` and
  ``optim.<param>.<state key>``; ``optimizer.json`` holds the param groups (parameters by name) and
  which state entries are tensors. DCP reshards on load, so it resumes at any number of ranks;
  ``read_dcp`` reassembles whole tensors in one process (no process group) for the local
  runtime, the replica strategy, ``masrl eval --checkpoint`` and ``masrl export``.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, TypeVar

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from masrl.errors import UserInputError
from masrl.io.atomic import as_if_opened
from masrl.paths import sha256_file

if TYPE_CHECKING:
    from masrl.training.policy import Policy, PolicyProtocol

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DCP_DIR = "dcp"  # policies/<name>/dcp: the sharded format (module docstring)
T = TypeVar("T")


class CheckpointError(UserInputError, RuntimeError):
    """A checkpoint is missing, partial, corrupt or does not fit the model."""


class CheckpointWarning(UserWarning):
    """A checkpoint that does not load and is skipped for the previous one (``masrl`` prints it as one line)."""


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass


def saved_parameter_names(policy: "Policy") -> set[str]:
    """Trainable parameters, plus the frozen base when SFT trained it (``policy.base_trained``)."""
    full = policy.base_trained
    return {n for n, p in policy.model.named_parameters() if full or p.requires_grad}


def trainable_state(policy: "Policy") -> dict[str, torch.Tensor]:
    names = saved_parameter_names(policy)
    return {n: p.detach().contiguous().clone() for n, p in policy.model.named_parameters() if n in names}


def optimizer_to_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = opt.state_dict()
    tensors, meta = {}, {"param_groups": sd["param_groups"], "state": {}}
    for idx, state in sd["state"].items():
        meta["state"][str(idx)] = {}
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"{idx}.{key}"] = value.detach().contiguous().clone()
                meta["state"][str(idx)][key] = "tensor"
            else:
                meta["state"][str(idx)][key] = value
    return tensors, meta


def optimizer_from_tensors(opt: torch.optim.Optimizer, tensors: Mapping[str, torch.Tensor], meta: dict) -> None:
    state = {}
    for idx, entries in meta["state"].items():
        state[int(idx)] = {k: (tensors[f"{idx}.{k}"] if v == "tensor" else v) for k, v in entries.items()}
    groups = meta["param_groups"]
    for g in groups:
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
    opt.load_state_dict({"state": state, "param_groups": groups})


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {"python": [list(x) if isinstance(x, tuple) else x for x in random.getstate()],
            "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
            "torch": torch.random.get_rng_state().tolist()}


def set_rng_state(state: Mapping[str, Any]) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.random.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))


def save_checkpoint(run_dir: Path, step: int, policies: Mapping[str, "PolicyProtocol"], trainer_state: dict,
                    keep: int = 2) -> Path:
    """Write ``run_dir/checkpoints/step_<step>`` atomically and prune to the newest ``keep``."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step}"
    for stale in root.glob(".step_*.tmp-*"):  # left by a crash mid-save; never loaded
        shutil.rmtree(stale, ignore_errors=True)
    tmp = root / f".step_{step}.tmp-{os.getpid()}"
    tmp.mkdir()
    files = []
    for name, policy in policies.items():
        if not policy.cfg.trainable:
            continue
        pdir = tmp / "policies" / name
        pdir.mkdir(parents=True)
        if policy.sharded_checkpoint:  # fsdp: every rank writes its shards into pdir/dcp
            (pdir / "optimizer.json").write_text(json.dumps(policy.save_sharded(str(pdir / DCP_DIR))))
            files += sorted(f for f in (pdir / DCP_DIR).rglob("*") if f.is_file()) + [pdir / "optimizer.json"]
            continue
        weights, tensors, meta = policy.checkpoint_state()
        save_file(weights, str(pdir / "model.safetensors"))
        save_file(tensors, str(pdir / "optimizer.safetensors"))
        as_if_opened(pdir / "model.safetensors", pdir / "optimizer.safetensors")  # safetensors writes 0600
        (pdir / "optimizer.json").write_text(json.dumps(meta))
        files += [pdir / "model.safetensors", pdir / "optimizer.safetensors", pdir / "optimizer.json"]
    state_path = tmp / "trainer_state.json"
    state_path.write_text(json.dumps({**trainer_state, "step": step, "rng": rng_state()}))
    files.append(state_path)
    manifest = {"format_version": FORMAT_VERSION, "step": step,
                "files": {str(f.relative_to(tmp)): sha256_file(f) for f in files}}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    for f in [*files, tmp / MANIFEST]:  # the manifest too: it is what makes the folder a checkpoint
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    for old in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step_") and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]))


def verify_checkpoint(path: Path) -> dict:
    """Return the manifest if every file is present and matches its checksum, else raise."""
    manifest_path = Path(path) / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{path}: no {MANIFEST} (partial checkpoint)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # not UTF-8, not JSON, a 5,000-digit number, too deep
        raise CheckpointError(f"{manifest_path}: unreadable manifest ({e})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or "trainer_state.json" not in files:
        raise CheckpointError(f"{manifest_path}: malformed manifest (no file list with trainer_state.json)")
    for rel, digest in files.items():
        f = Path(path) / rel
        if not f.is_file():
            raise CheckpointError(f"{path}: missing file {rel}")
        if sha256_file(f) != digest:
            raise CheckpointError(f"{path}: checksum mismatch for {rel} (corrupt checkpoint)")
    return manifest


def newest_loadable(run_dir: Path, load: Callable[[Path], T]) -> tuple[Path, T] | None:
    """``(path, load(path))`` for the newest checkpoint of ``run_dir`` that ``load`` reads without a
    ``CheckpointError``; each one that fails (a checksum, a damaged safetensors header, weights that do not
    fit) is reported in one ``UserWarning`` line naming the file and why, and the previous step is tried.
    None: none loads. The one fallback rule of ``--resume``, ``masrl eval --checkpoint RUN_DIR`` and
    ``masrl export`` without ``--step``."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return path, load(path)
        except CheckpointError as e:
            warnings.warn(f"skipping checkpoint: {e}; falling back to the previous one", CheckpointWarning,
                          stacklevel=2)
    return None


def latest_valid_checkpoint(run_dir: Path) -> Path | None:
    """The newest checkpoint that verifies against its manifest (``newest_loadable``); None: none does."""
    found = newest_loadable(run_dir, verify_checkpoint)
    return found[0] if found else None


def policy_weights(path: Path, name: str) -> dict[str, torch.Tensor]:
    """The saved weights of policy ``name`` in checkpoint ``path`` (either format; verify the checkpoint
    first), or a ``CheckpointError`` naming the file that does not load."""
    pdir = Path(path) / "policies" / name
    if (pdir / DCP_DIR).is_dir():
        return dcp_weights(pdir)
    if not (pdir / "model.safetensors").is_file():
        raise CheckpointError(f"{path}: no weights for policy {name!r}; was it trained with another config?")
    return _read_tensors(pdir / "model.safetensors")


def load_checkpoint(path: Path, policies: Mapping[str, "PolicyProtocol"], *, load_optimizer: bool = True) -> dict:
    """Load weights (and optimizer state) into ``policies``; returns the trainer state.

    Every file is read and checked before any policy is touched; every way a file can fail to load
    (a checksum, a safetensors header or JSON that does not parse although it was hashed, a trainer
    state without its fields, weights or optimizer state that do not fit) is a ``CheckpointError``.
    """
    state, loaded = _read_checkpoint(Path(path), policies, load_optimizer)
    for name, entry in loaded.items():
        where = f"{path}: policy {name!r}"
        if isinstance(entry, ShardedState):  # fsdp ranks read their own shards (DCP reshards)
            policies[name].load_sharded(str(entry.folder), entry.optimizer_meta, where)
        else:
            policies[name].restore_state(*entry, where)
    return state


def load_latest_checkpoint(run_dir: Path, policies: Mapping[str, "PolicyProtocol"], *,
                           load_optimizer: bool = True) -> tuple[Path, dict] | None:
    """``(path, trainer state)`` of the newest checkpoint that verifies and loads into ``policies``;
    each one that does not is reported (``UserWarning``) and the previous one tried (``newest_loadable``).
    None: none loads."""
    return newest_loadable(run_dir, lambda path: load_checkpoint(path, policies, load_optimizer=load_optimizer))


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointError(f"{path}: unreadable ({type(e).__name__}: {e})") from None


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - SafetensorError (header), OSError, ...: the file does not load
        raise CheckpointError(f"{path}: unreadable safetensors file ({type(e).__name__}: {e})") from None


def _read_checkpoint(path: Path, policies: Mapping[str, "PolicyProtocol"], load_optimizer: bool) -> tuple[dict, dict]:
    """(trainer state, {policy: (weights, optimizer tensors, optimizer metadata)}), all read and checked."""
    verify_checkpoint(path)
    state = _read_json(path / "trainer_state.json")
    if not isinstance(state, dict) or type(state.get("step")) is not int or state["step"] < 0:
        raise CheckpointError(f"{path}/trainer_state.json: no step (not a masrl trainer state)")
    if not isinstance(state.get("rng", {}), dict) or not isinstance(state.get("history", {}), dict):
        raise CheckpointError(f"{path}/trainer_state.json: malformed rng or history")
    loaded = {}
    for name, policy in policies.items():
        pdir = path / "policies" / name
        if not policy.cfg.trainable:
            continue
        if not pdir.is_dir():
            raise CheckpointError(f"{path}: no weights for policy {name!r}; was it trained with another config?")
        with_optimizer = load_optimizer and policy.optimizer is not None
        if (pdir / DCP_DIR).is_dir():
            meta = _read_optimizer_meta(pdir)
            if policy.sharded_checkpoint:
                loaded[name] = ShardedState(pdir / DCP_DIR, meta if with_optimizer else None)
            else:
                loaded[name] = consolidate_dcp(pdir, meta, with_optimizer)
            continue
        weights, opt_tensors, meta = _read_tensors(pdir / "model.safetensors"), None, None
        if with_optimizer:
            meta = _read_optimizer_meta(pdir)
            opt_tensors = _read_tensors(pdir / "optimizer.safetensors")
        loaded[name] = (weights, opt_tensors, meta)
    return state, loaded


def _read_optimizer_meta(pdir: Path) -> dict:
    meta = _read_json(pdir / "optimizer.json")
    if not isinstance(meta, dict) or not isinstance(meta.get("state"), dict) \
            or not isinstance(meta.get("param_groups"), list):
        raise CheckpointError(f"{pdir}/optimizer.json: malformed optimizer state")
    return meta


@dataclass
class ShardedState:
    """A policy's sharded (DCP) checkpoint, for its fsdp ranks to read: the folder and the optimizer
    metadata (None: weights only)."""

    folder: Path
    optimizer_meta: dict | None


def dcp_model_key(name: str) -> str:
    return f"model.{name}"


def dcp_optim_key(param: str, key: str) -> str:
    return f"optim.{param}.{key}"


def dcp_keys(folder: Path) -> set[str]:
    """The tensor names a DCP folder holds (read from its safetensors headers)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    try:
        return set(HuggingFaceStorageReader(str(folder)).read_metadata().state_dict_metadata)
    except Exception as e:  # noqa: BLE001 - a header that does not parse, a missing file: it does not load
        raise CheckpointError(f"{folder}: unreadable sharded checkpoint ({type(e).__name__}: {e})") from None


def read_dcp(folder: Path, keys: set[str] | None = None) -> dict[str, torch.Tensor]:
    """Whole tensors (``keys``, default all) from a DCP folder, in this process and without a process
    group: DCP reassembles each tensor from the ranks' shards."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    try:
        metadata = HuggingFaceStorageReader(str(folder)).read_metadata().state_dict_metadata
        state = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in metadata.items()
                 if keys is None or k in keys}
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=True)
    except Exception as e:  # noqa: BLE001 - as dcp_keys
        raise CheckpointError(f"{folder}: unreadable sharded checkpoint ({type(e).__name__}: {e})") from None
    return state


def dcp_weights(pdir: Path) -> dict[str, torch.Tensor]:
    """A sharded policy folder's whole weights, by parameter name."""
    prefix = dcp_model_key("")
    full = read_dcp(pdir / DCP_DIR, {k for k in dcp_keys(pdir / DCP_DIR) if k.startswith(prefix)})
    return {k[len(prefix):]: v for k, v in full.items()}


def consolidate_dcp(pdir: Path, meta: dict, with_optimizer: bool):
    """A sharded policy folder as the consolidated format's (weights, optimizer tensors, optimizer metadata)
    (optimizer parts None: weights only, or no optimizer state saved yet)."""
    weights = dcp_weights(pdir)
    if not with_optimizer or not meta["state"]:
        return weights, None, None
    try:
        order = [name for group in meta["param_groups"] for name in group["params"]]
        index = {name: i for i, name in enumerate(order)}
        groups = [{**g, "params": [index[n] for n in g["params"]]} for g in meta["param_groups"]]
        wanted = {dcp_optim_key(n, k): (index[n], k) for n, entries in meta["state"].items()
                  for k, v in entries.items() if v == "tensor"}
        state = {str(index[n]): dict(entries) for n, entries in meta["state"].items()}
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{pdir}/optimizer.json: malformed optimizer state ({type(e).__name__}: {e})") from None
    full = read_dcp(pdir / DCP_DIR, set(wanted))
    if set(full) != set(wanted):
        raise CheckpointError(f"{pdir / DCP_DIR}: optimizer tensors missing ({sorted(set(wanted) - set(full))[:3]})")
    tensors = {f"{i}.{k}": full[key] for key, (i, k) in wanted.items()}
    return weights, tensors, {"param_groups": groups, "state": state}


def consolidated_state(policy: "Policy") -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """(weights, optimizer tensors, optimizer metadata) of a local policy (``Policy.checkpoint_state``)."""
    tensors, meta = optimizer_to_tensors(policy.optimizer)
    return trainable_state(policy), tensors, meta


def restore_consolidated(policy: "Policy", weights: Mapping[str, torch.Tensor],
                         opt_tensors: Mapping[str, torch.Tensor] | None, opt_meta: dict | None,
                         where: str = "checkpoint") -> None:
    """Copy saved weights (and optimizer state) into a local policy's model and optimizer; names must fit its
    model exactly (``Policy.restore_state``, which then serves them from the rollout engine)."""
    expected = saved_parameter_names(policy)
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights))[:3], sorted(set(weights) - expected)[:3]
        raise CheckpointError(f"{where} weights do not fit the model (missing {missing}, unexpected {extra})")
    params = dict(policy.model.named_parameters())
    wrong = [n for n, t in weights.items() if t.shape != params[n].shape]
    if wrong:
        raise CheckpointError(f"{where} weights do not fit the model ({wrong[0]}: shape "
                              f"{tuple(weights[wrong[0]].shape)}, the model has {tuple(params[wrong[0]].shape)})")
    with torch.no_grad():
        for n, t in weights.items():
            params[n].copy_(t)
    if opt_tensors is not None and policy.optimizer is not None:
        try:
            optimizer_from_tensors(policy.optimizer, opt_tensors, opt_meta)
        except (KeyError, TypeError, ValueError, IndexError, RuntimeError) as e:
            raise CheckpointError(f"{where}: optimizer state does not fit ({type(e).__name__}: {e})") from None


def load_eval_checkpoint(path: str | Path, policies) -> Path:
    """Load ``RUN_DIR/checkpoints/step_N`` (that one) or ``RUN_DIR`` (its newest checkpoint that loads, falling
    back past broken ones as ``--resume`` does) into ``policies``, weights only; returns the step folder
    (``masrl eval`` and ``masrl ensemble collect`` ``--checkpoint``)."""
    from masrl.errors import ConfigError

    p = Path(path)
    if (p / "manifest.json").is_file():
        load_checkpoint(p, policies, load_optimizer=False)
        return p
    found = load_latest_checkpoint(p, policies, load_optimizer=False)
    if found is None:
        raise ConfigError(f"--checkpoint {path}: no valid checkpoint there (expected RUN_DIR or RUN_DIR/checkpoints/step_N)")
    return found[0]
