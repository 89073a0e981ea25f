"""Export a run's checkpoint as Hugging Face model folders and PEFT adapter folders.

A checkpoint keeps only what training changed (a full policy's weights, or its LoRA adapters,
plus the base when SFT trained it). The export rebuilds each policy's model exactly as the
trainer did (``config.yaml``: the same tiny model from the same seed, the same hub model,
the same adapters), copies the checkpoint's tensors into it, and writes:

    OUT/README.md, OUT/export.json, OUT/config.yaml   card, what was exported, an eval config
    OUT/<policy>/                  full policy: config.json, generation_config.json, tokenizer,
                                   safetensors (sharded above ``max_shard_size``, with an index)
    OUT/<policy>/base/             LoRA policy: the base model folder (as above)
    OUT/<policy>/adapters/<name>/  one PEFT adapter per role (or one per policy when shared)
    OUT/<policy>[/<role>]/         --merge-lora: each adapter merged into full weights

Everything is written under a temporary folder next to ``OUT`` and renamed into place.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch
import yaml
from safetensors.torch import save_file

from masrl.io.atomic import as_if_opened
from masrl.config import RunConfig, load_config
from masrl.errors import ConfigError, UserInputError
from masrl.paths import check_output_dir
from masrl.models.loading import load_model_and_tokenizer
from masrl.training import checkpoint as ckpt


class ExportError(UserInputError, ValueError):
    """A run folder, checkpoint or policy that cannot be exported; one line (the CLI exits 2)."""


DEFAULT_SHARD_SIZE = "5GB"


def export_run(run_dir: str | Path, out: str | Path, *, step: int | None = None,
               policies: Sequence[str] | None = None, merge_lora: bool = False,
               max_shard_size: int | str = DEFAULT_SHARD_SIZE, overwrite: bool = False) -> Path:
    """Export the policies of ``run_dir`` (default: every trained one) from checkpoint ``step``
    (default: the last valid one, as ``--resume`` picks) into ``out``; returns ``out``."""
    run_dir = Path(run_dir)
    out = check_output_dir(out, "--out").resolve()  # checked before resolve() follows a symlink
    check_destination(run_dir, out, overwrite)
    cfg = read_run_config(run_dir)
    names = pick_policies(cfg, policies)
    path, weights = pick_checkpoint(run_dir, step, names)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        exported = {name: export_policy(cfg, name, weights.pop(name), path, tmp, out, merge_lora=merge_lora,
                                        max_shard_size=max_shard_size) for name in names}
        report = _read_report(run_dir)
        manifest = {"run_dir": str(run_dir.resolve()), "checkpoint": str(path.resolve()),
                    "step": int(path.name[5:]), "merge_lora": merge_lora, "policies": exported}
        (tmp / "export.json").write_text(json.dumps(manifest, indent=1))
        (tmp / "config.yaml").write_text(eval_config(cfg, exported, out))
        from masrl.export.card import model_card

        (tmp / "README.md").write_text(model_card(cfg, report, manifest))
        for name, info in exported.items():
            for key, folder in info["folders"].items():
                library = "peft" if info["kind"] == "lora" and key != "base" else "transformers"
                (tmp / folder / "README.md").write_text(model_card(cfg, report, manifest, library))
        _replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


# ------------------------------------------------------------------------------ inputs

def check_destination(run_dir: Path, out: Path, overwrite: bool) -> None:
    """``out`` may be created, or replaced with ``overwrite`` only when it is an earlier export (it holds
    export.json) or an empty folder: never the run folder, a folder holding it, another run, or a file."""
    if run_dir.exists() and (out == run_dir.resolve() or out in run_dir.resolve().parents):
        raise ExportError(f"--out {out} would replace the run folder {run_dir} (it is that folder or holds it); "
                          f"choose a new folder, e.g. --out {run_dir / 'export'}")
    if not out.exists():
        return
    if not overwrite:
        raise ExportError(f"--out {out} already exists; choose another folder or pass --overwrite")
    if out.is_dir() and ((out / "export.json").is_file() or not any(out.iterdir())):
        return
    raise ExportError(f"--out {out} is not an earlier masrl export (no export.json) and not empty; --overwrite only "
                      "replaces an export: choose another folder")


def read_run_config(run_dir: Path) -> RunConfig:
    cfg_path = run_dir / "config.yaml"
    if not run_dir.is_dir():
        raise ExportError(f"run folder {run_dir} does not exist")
    if not cfg_path.is_file():
        raise ExportError(f"{run_dir}: no config.yaml there; is it a masrl run folder?")
    try:
        return load_config(cfg_path)
    except ConfigError as e:
        raise ExportError(f"{cfg_path}: {e}") from None


def pick_checkpoint(run_dir: Path, step: int | None, names: Sequence[str]) -> tuple[Path, dict[str, dict]]:
    """``(checkpoints/step_<step>, {policy: saved weights})``; without ``step`` the newest checkpoint whose
    weights load (``ckpt.newest_loadable``: damaged ones are named in a warning and skipped, as ``--resume``
    does). An explicit step that does not load is one ``ExportError`` naming the file."""
    found = ckpt.list_checkpoints(run_dir)
    if not found:
        raise ExportError(f"{run_dir}: no checkpoints under {run_dir / 'checkpoints'}; train first "
                          "(`masrl train`; checkpoints are written at the end and every trainer.save_every steps)")

    def load(path: Path) -> dict[str, dict]:
        ckpt.verify_checkpoint(path)
        return {name: ckpt.policy_weights(path, name) for name in names}

    if step is None:
        picked = ckpt.newest_loadable(run_dir, load)
        if picked is None:
            raise ExportError(f"{run_dir}: no checkpoint loads (each one fails its manifest check or a file "
                              "does not load; see the warnings)")
        return picked
    path = run_dir / "checkpoints" / f"step_{step}"
    if path not in found:
        steps = ", ".join(p.name[5:] for p in found)
        raise ExportError(f"--step {step}: no checkpoint step_{step} in {run_dir / 'checkpoints'}; "
                          f"steps there: {steps}")
    try:
        return path, load(path)
    except ckpt.CheckpointError as e:
        raise ExportError(f"--step {step}: {e}") from None


def pick_policies(cfg: RunConfig, requested: Sequence[str] | None) -> list[str]:
    trained = [n for n, p in cfg.policies.items() if p.trainable]
    if not requested:
        if not trained:
            raise ExportError("no trainable policy in this run: nothing was trained, so nothing to export")
        return trained
    for name in requested:
        if name not in cfg.policies:
            raise ExportError(f"--policy {name}: unknown policy; the run's policies: {', '.join(cfg.policies)}")
        if name not in trained:
            raise ExportError(f"--policy {name}: the policy is not trainable (trainable: false), so its model "
                              f"{cfg.policies[name].model!r} is unchanged; use that directly")
    return list(dict.fromkeys(requested))


def _read_report(run_dir: Path) -> dict:
    try:
        return json.loads((run_dir / "report.json").read_text())
    except (OSError, ValueError):
        return {}


# ------------------------------------------------------------------------------ models

def policy_agents(cfg: RunConfig, name: str) -> list[str]:
    return [a for a, acfg in cfg.agents.items() if acfg.policy == name]


def rebuild_policy(cfg: RunConfig, name: str, weights: dict[str, torch.Tensor], checkpoint: Path):
    """``(model, tokenizer)`` of policy ``name`` as the trainer built it, with the checkpoint's ``weights``.

    A LoRA policy's model is the PEFT model (its adapters named as in training: one per role,
    or the policy's name when shared).
    """
    pcfg = cfg.policies[name]
    model, tokenizer = load_model_and_tokenizer(pcfg, seed=cfg.seed)
    if pcfg.lora is not None:
        from masrl.models.lora import attach_adapters

        lora = pcfg.lora
        adapters = policy_agents(cfg, name) if lora.per_agent else [name]
        model = attach_adapters(model, adapters, r=lora.r, alpha=lora.alpha, dropout=lora.dropout,
                                target_modules=lora.target_modules)
    load_weights(model, weights, where=f"{checkpoint}: policy {name!r}")
    return model.eval(), tokenizer


def load_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor], where: str) -> None:
    """Copy the checkpoint's tensors in: they must be the trainable parameters (adapters, or the
    whole model) or every parameter (a base trained by SFT under adapters)."""
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    if set(weights) not in (trainable, set(params)):
        missing = sorted(trainable - set(weights))[:3]
        extra = sorted(set(weights) - set(params))[:3]
        raise ExportError(f"{where}: the saved weights do not fit the model built from config.yaml "
                          f"(missing {missing}, unexpected {extra}); was config.yaml edited after training?")
    with torch.no_grad():
        for key, tensor in weights.items():
            if tensor.shape != params[key].shape:
                raise ExportError(f"{where}: {key} has shape {tuple(tensor.shape)}, the model "
                                  f"{tuple(params[key].shape)}")
            params[key].copy_(tensor)


def save_model_folder(model, tokenizer, folder: Path, max_shard_size: int | str) -> None:
    """A folder that ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` load."""
    model.save_pretrained(str(folder), max_shard_size=max_shard_size)
    tokenizer.save_pretrained(str(folder))


def save_adapter(model, adapter: str, folder: Path, base_path: Path) -> None:
    """One PEFT adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``, PEFT's keys)."""
    from peft.utils import get_peft_model_state_dict

    config = copy.deepcopy(model.peft_config[adapter])
    config.base_model_name_or_path = str(base_path)
    config.inference_mode = True
    folder.mkdir(parents=True)
    config.save_pretrained(str(folder))
    state = get_peft_model_state_dict(model, adapter_name=adapter)
    save_file({k: v.detach().to("cpu").contiguous() for k, v in state.items()},
              str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})


def merged_model(model, adapter: str):
    """A plain model: the base with ``adapter`` merged into its weights (``model`` is left as it is)."""
    return copy.deepcopy(model).merge_and_unload(adapter_names=[adapter])


def export_policy(cfg: RunConfig, name: str, weights: dict[str, torch.Tensor], checkpoint: Path, tmp: Path,
                  final: Path, *, merge_lora: bool, max_shard_size: int | str) -> dict[str, Any]:
    """Write policy ``name`` under ``tmp``; returns its entry of export.json (folders relative to the
    export: ``{"model": "p"}``, or ``{"base": "p/base", "<adapter>": "p/adapters/<adapter>"}``...)."""
    pcfg = cfg.policies[name]
    model, tokenizer = rebuild_policy(cfg, name, weights, checkpoint)
    if pcfg.lora is None:
        save_model_folder(model, tokenizer, tmp / name, max_shard_size)
        return {"kind": "full", "agents": policy_agents(cfg, name), "folders": {"model": name}}
    from masrl.models.lora import adapter_names

    adapters = adapter_names(model)
    if merge_lora:
        folders = {a: name if len(adapters) == 1 and not pcfg.lora.per_agent else f"{name}/{a}" for a in adapters}
        for adapter, rel in folders.items():
            save_model_folder(merged_model(model, adapter), tokenizer, tmp / rel, max_shard_size)
        return {"kind": "merged", "agents": policy_agents(cfg, name), "per_agent": pcfg.lora.per_agent,
                "folders": folders}
    folders = {"base": f"{name}/base", **{a: f"{name}/adapters/{a}" for a in adapters}}
    for adapter in adapters:  # with the tokenizer: the folder also loads alone (a merged model, in masrl)
        save_adapter(model, adapter, tmp / folders[adapter], final / folders["base"])
        tokenizer.save_pretrained(str(tmp / folders[adapter]))
    save_model_folder(model.unload(), tokenizer, tmp / folders["base"], max_shard_size)
    return {"kind": "lora", "agents": policy_agents(cfg, name), "per_agent": pcfg.lora.per_agent,
            "folders": folders}


# ------------------------------------------------------------------------------ outputs

def eval_config(cfg: RunConfig, exported: dict[str, dict], out: Path) -> str:
    """The run's config with every exported policy loaded from the export (``masrl eval OUT/config.yaml``).

    Full and LoRA policies keep their names; a per-role merged LoRA policy becomes one policy per
    role (``<policy>-<role>``), each agent mapped to its own merged model.
    """
    data = cfg.model_dump(mode="json")
    data["trainer"]["export"] = False
    data["output_dir"] = str(out / "runs" / "{name}-{estimator}-seed{seed}")  # never the original run folder
    data["sft"]["steps"] = 0
    for name, info in exported.items():
        pol = data["policies"][name]
        pol["tiny"], pol["init_seed"], pol["tokenizer"] = {}, None, None
        folders = info["folders"]
        if info["kind"] == "full":
            pol["model"] = str(out / folders["model"])
        elif info["kind"] == "lora":
            pol["model"] = str(out / folders["base"])
            pol["lora"]["init_from"] = str(out / name / "adapters")
        elif not info["per_agent"]:
            pol["model"], pol["lora"] = str(out / folders[name]), None
        else:
            del data["policies"][name]
            for agent in info["agents"]:
                data["policies"][f"{name}-{agent}"] = {**pol, "model": str(out / folders[agent]), "lora": None}
                data["agents"][agent]["policy"] = f"{name}-{agent}"
    runtime_policies = data.get("runtime", {}).get("policies", {})
    for name, info in exported.items():  # placements of a split policy apply to each part
        if info["kind"] == "merged" and info["per_agent"] and name in runtime_policies:
            place = runtime_policies.pop(name)
            runtime_policies.update({f"{name}-{a}": place for a in info["agents"]})
    header = (f"# masrl export: the run's config with the exported policies ({out}).\n"
              f"# Evaluate them with: masrl eval {out / 'config.yaml'}\n")
    left_out = [n for n, p in cfg.policies.items() if p.trainable and n not in exported]
    if left_out:
        header += (f"# Not in this export, so built as at the start of training (their trained weights are in the "
                   f"run's checkpoints): {', '.join(left_out)}\n")
    return header + yaml.safe_dump(data, sort_keys=False)


def _replace(tmp: Path, out: Path) -> None:
    """Rename ``tmp`` to ``out``; an existing ``out`` (overwrite) is moved aside first, then removed. Its files get
    the mode a plain ``open`` gives (safetensors writes weights 0600)."""
    as_if_opened(*(f for f in tmp.rglob("*") if f.is_file() and not f.is_symlink()))
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.replace(out, old)
    os.replace(tmp, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
