"""masrl.plan.memory: the memory settings a config leaves unset, chosen from the model and the machine's memory.

The thresholds below are computed by hand for SmolLM2-135M (h 576, L 30, 9 heads, 3 kv heads of 64, i 1536,
V 49152), per-agent LoRA r 16 on q/k/v/o for two agents, float32, prompts sized 512 + 64 tokens:
* activations of T tokens: T*L*(5h + 2k + 2.5i)*4 (LoRA on attention only: 7,104 values per layer and token)
  + L*T*576*9*4 (attention probabilities) + 3*min(T*64//576, 1024)*V*4 (the LM head's chunk);
  T = 1024: 872,939,520 + 637,009,920 + 66,650,112 = 1,576,599,552 bytes, so 1024 needs M >= 12 x that;
* keys/values per row: 2*30*192*576*4 = 26,542,080 bytes, so 64 rows need M >= 8 x 64 x that;
* the whole predicted peak, weights + LoRA state + activations + keys/values + the prefix cache at 1.8x its size
  (its resident cost, PREFIX_RESIDENT), within M/6: the unset micro-batch and rows halve in turn until the
  smallest cache (64 MiB) fits; the cache is the largest power of two (64..1024 MiB) that fits.
"""
from __future__ import annotations

import math

import pytest

from masrl.config import load_config
from masrl.plan.memory import apply_memory_defaults, choose_memory_defaults, format_memory_defaults

GiB = 2 ** 30
ACT_1024 = 1024 * 30 * 7104 * 4 + 30 * 1024 * 576 * 9 * 4 + 3 * (1024 * 64 // 576) * 49152 * 4
KV_ROW = 2 * 30 * 192 * 576 * 4
MiB = 2 ** 20
PARAMS = 30 * (576 * (576 + 2 * 192) + 576 * 576 + 3 * 576 * 1536 + 2 * 576) + 49152 * 576 + 576
LORA = 16 * (2 * (576 + 576) + 2 * (576 + 192)) * 30 * 2  # r 16 on q/k/v/o, 30 layers, 2 agents
PERSISTENT = (PARAMS + LORA) * 4 + LORA * 4 + 2 * LORA * 4  # weights, LoRA gradients, AdamW moments
BASE = PERSISTENT + ACT_1024 + 64 * KV_ROW  # the predicted peak without the prefix cache, 1024 tokens, 64 rows


def _team(*overrides: str):
    return load_config("examples/smollm2_arith_team.yaml", ["trainer.autocast=float32", "trainer.memory_defaults=true",
                                                             *overrides])


def _chosen(cfg, memory: float) -> dict:
    return {c.key: c.value for c in choose_memory_defaults(cfg, int(memory))}


def test_hand_computed_terms():
    assert ACT_1024 == 1_576_599_552 and KV_ROW == 26_542_080
    assert PARAMS == 134_515_008 and LORA == 3_686_400 and BASE == 3_872_335_104


def _base(tokens: int, rows: int) -> int:
    """The predicted peak without the prefix cache (float32): weights and LoRA state, activations, keys/values."""
    act = tokens * 30 * 7104 * 4 + 30 * tokens * 576 * 9 * 4 + 3 * min(tokens * 64 // 576, 1024) * 49152 * 4
    return PERSISTENT + act + rows * KV_ROW


FLOOR = 64 * MiB * 1.8  # the smallest prefix cache at its resident size (PREFIX_RESIDENT)
FITS_1024 = 6 * BASE + math.ceil(6 * FLOOR)  # 22.31 GiB: 1024 tokens, 64 rows and a 64 MiB cache within M/6


@pytest.mark.parametrize("memory, tokens, rows, prefix", [
    # the 2-core development machine: (M/6 - base) / 1.8 = 176.5 MiB -> 128
    (23.5 * GiB, 1024, 64, 128),
    (FITS_1024, 1024, 64, 64),
    # 1 byte less: the micro-batch halves, which leaves (M/6 - _base(512, 64)) / 1.8 = 481.8 MiB -> 256
    (FITS_1024 - 1, 512, 64, 256),
    # 12 x 1024 tokens' activations (17.62 GiB): 1024 tokens and 64 rows pass M/6, so does 512 with 64 rows
    # (2.98 > 2.94 GiB); 512 tokens and 32 rows fit, leaving 486.8 MiB -> 256
    (12 * ACT_1024, 512, 32, 256),
    # 1 byte less: M/12 gives 512 tokens; 512 with 64 rows passes M/6, 256 with 64 fits: 245.6 MiB -> 128
    (12 * ACT_1024 - 1, 256, 64, 128),
    # just below 64 rows (12.66 GiB): 512 tokens and 32 rows pass M/6, 256 and 32 fit: 224.9 MiB -> 128
    (8 * 64 * KV_ROW - 1, 256, 32, 128),
    # 4096 tokens would need 70.5 GiB; 2048 tokens and 256 rows fit M/6 with 480.9 MiB -> 256
    (64 * GiB, 2048, 256, 256),
])
def test_smollm2_team_settings_follow_the_hand_computed_thresholds(memory, tokens, rows, prefix):
    """M/12 for the micro-batch and M/8 for the rows first; then the whole predicted peak (with at least a 64 MiB
    prefix cache at 1.8x its size) must fit M/6: the unset micro-batch and rows halve in turn until it does; the
    prefix cache fills what is left."""
    chosen = _chosen(_team(), memory)
    assert chosen["trainer.micro_batch_tokens"] == tokens
    assert chosen["trainer.max_rollout_batch"] == rows
    assert chosen["rollout.prefix_cache_mib"] == prefix
    assert (memory / 6 - _base(tokens, rows)) / 1.8 >= prefix * MiB
    assert chosen["policies.smol.gradient_checkpointing"] is False and chosen["trainer.tune_malloc"] is True
    assert "rollout.keep_decode_weights" not in chosen  # float32 decoding keeps no bf16 copies
    assert chosen["trainer.primitive_cache"] == 64  # oneDNN's and ideep's kernel caches: 64 entries, not 1024


def test_bf16_autocast_on_a_cpu_counts_its_activations_and_decode_copies():
    """Under bf16 autocast a float32 model's activations count at 1.1x the float32 formula (AUTOCAST_CPU_ACTIVATIONS)
    and decoding adds bf16 copies of the weights, 1.5 x 2 bytes per parameter; those are released during updates."""
    import masrl.plan.memory as memory

    act_1024 = 1.1 * ACT_1024
    copies = 3 * PARAMS  # 403,545,024 bytes
    # 23.5 GiB: 1024 tokens (1.62 GiB <= M/12) and 64 rows, but PERSISTENT + copies + activations + 64 rows +
    # FLOOR = 4.24 GiB > M/6 = 3.92: the micro-batch halves to 512 (3.43 GiB), and the prefix cache gets
    # (M/6 - 3.32 GiB) / 1.8 = 338.8 MiB -> 256
    chosen = _chosen(_team("trainer.autocast=bfloat16"), 23.5 * GiB)
    assert (PERSISTENT + copies + act_1024 + 64 * KV_ROW + FLOOR) / GiB == pytest.approx(4.2416, abs=1e-4)
    base = PERSISTENT + copies + 1.1 * (ACT_1024 - 788_594_688) + 64 * KV_ROW  # ACT_512 = ACT_1024 - 788,594,688
    assert chosen["trainer.micro_batch_tokens"] == 512 and chosen["trainer.max_rollout_batch"] == 64
    assert chosen["rollout.prefix_cache_mib"] == 256
    assert (23.5 * GiB / 6 - base) / 1.8 / MiB == pytest.approx(338.77, abs=0.01)
    assert chosen["rollout.keep_decode_weights"] is False
    assert memory.DECODE_COPIES * PARAMS == copies


def test_a_small_machine_gets_checkpointing_and_the_lean_allocator():
    # 2 GiB: 256-token micro-batches, and the update (weights 0.55 GB + LoRA state + activations) passes M/4
    chosen = _chosen(_team(), 2 * GiB)
    assert chosen["trainer.micro_batch_tokens"] == 256
    assert chosen["policies.smol.gradient_checkpointing"] is True
    assert chosen["trainer.tune_malloc"] == "lean"


def test_settings_the_user_gives_always_win():
    cfg = _team("trainer.micro_batch_tokens=4096", "rollout.prefix_cache_mib=1024", "trainer.tune_malloc=true",
                "policies.smol.gradient_checkpointing=false", "trainer.max_rollout_batch=512",
                "trainer.primitive_cache=1024")
    assert apply_memory_defaults(cfg, 2 * GiB) == []
    t = cfg.trainer
    assert (t.micro_batch_tokens, cfg.rollout.prefix_cache_mib, t.tune_malloc,
            cfg.policies["smol"].gradient_checkpointing, t.max_rollout_batch,
            t.primitive_cache) == (4096, 1024, True, False, 512, 1024)


def test_memory_defaults_false_keeps_the_fixed_defaults():
    cfg = _team("trainer.memory_defaults=false")
    assert apply_memory_defaults(cfg, 2 * GiB) == []
    assert apply_memory_defaults(load_config("examples/quickstart.yaml"), 2 * GiB) == []  # off by default
    t = cfg.trainer
    assert (t.micro_batch_tokens, t.max_rollout_batch, cfg.rollout.prefix_cache_mib) == (4096, 512, 1024)
    assert t.primitive_cache is None  # the libraries' own capacities


def test_masrl_train_applies_them_before_building_and_says_so(monkeypatch, capsys):
    import masrl.plan.memory as memory
    from masrl import cli

    monkeypatch.setattr(memory, "machine_memory", lambda: int(23.5 * GiB))
    cfg = _team("trainer.max_rollout_batch=128")
    memory.announce_memory_defaults(cfg)
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("[masrl] memory defaults for M = 23.5 GiB")
    # the 128 rows given pass M/6 with any micro-batch: it halves to its floor, and the line says the peak passes M/6
    assert "trainer.micro_batch_tokens=256" in err and "max_rollout_batch" not in err and "M/6 3.92" in err
    assert cfg.trainer.micro_batch_tokens == 256 and cfg.trainer.max_rollout_batch == 128


def test_the_smollm2_team_example_ships_them_on_and_its_study_specs_keep_the_fixed_settings():
    """The example's shipped settings stay within 4 GB (benchmarks/RESULTS.md); the study specs built on it keep
    the fixed settings their published figures used."""
    import yaml

    assert load_config("examples/smollm2_arith_team.yaml").trainer.memory_defaults is True
    for spec in ("e1bc_smollm2", "e1bc_smollm2_balanced", "smollm2_long", "smollm2_long_shared",
                 "e7_dynamic_sampling_smollm2"):
        data = yaml.safe_load(open(f"benchmarks/study/{spec}.yaml"))
        assert data["base"] == "examples/smollm2_arith_team.yaml" and "trainer.memory_defaults=false" in data["overrides"]


def test_masrl_eval_applies_them_too(monkeypatch, capsys, tmp_path):
    """`masrl eval` of a config with memory_defaults decodes with the rows, cache and allocator training chose: the
    line is printed before the team is built (the team's build is stopped there: nothing else is under test)."""
    import masrl.plan.memory as memory
    import masrl.team_runner as team_runner
    from masrl import cli

    class Built(Exception):
        pass

    def stop(cfg, **kw):
        assert cfg.trainer.max_rollout_batch == 64 and cfg.rollout.prefix_cache_mib == 128
        raise Built

    monkeypatch.setattr(memory, "machine_memory", lambda: int(23.5 * GiB))
    monkeypatch.setattr(team_runner, "TeamRunner", stop)
    with pytest.raises(Built):
        cli.main(["eval", "examples/smollm2_arith_team.yaml", "trainer.memory_defaults=true", "trainer.autocast=float32",
                  "--checkpoint", "none", "--out", str(tmp_path / "e")])  # float32: the choices depend on bf16
    err = capsys.readouterr().err
    assert err.count("[masrl] memory defaults") == 1 and "trainer.max_rollout_batch=64" in err


def test_apply_sets_the_choices_and_one_line_names_them():
    cfg = _team()
    choices = apply_memory_defaults(cfg, int(23.5 * GiB))
    t = cfg.trainer
    assert (t.micro_batch_tokens, t.max_rollout_batch, cfg.rollout.prefix_cache_mib) == (1024, 64, 128)
    line = format_memory_defaults(choices, int(23.5 * GiB))
    assert line.count("\n") == 0 and "M = 23.5 GiB" in line
    assert "trainer.micro_batch_tokens=1024" in line and "rollout.prefix_cache_mib=128" in line
    assert apply_memory_defaults(cfg, int(23.5 * GiB)) == []  # all set now: a second pass changes nothing


def test_the_tiny_quickstart_keeps_its_update_and_decode_sizes():
    chosen = _chosen(load_config("examples/quickstart.yaml", ["trainer.autocast=float32"]), 23.5 * GiB)
    assert chosen["trainer.micro_batch_tokens"] == 4096 and chosen["trainer.max_rollout_batch"] == 512


def test_gpu_runs_keep_the_fixed_defaults():
    assert _chosen(_team("trainer.device=cuda"), 8 * GiB) == {}


def test_a_model_whose_shape_is_not_at_hand_keeps_the_fixed_defaults(tmp_path):
    cfg = _team(f"policies.smol.model={tmp_path}")  # a folder without config.json
    with pytest.warns(UserWarning, match="memory defaults: not chosen"):
        assert apply_memory_defaults(cfg, 2 * GiB) == []
    assert cfg.trainer.micro_batch_tokens == 4096
