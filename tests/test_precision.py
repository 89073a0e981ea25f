"""trainer.autocast: the ``auto`` rule (bfloat16 where the device computes it natively, float32 elsewhere),
explicit values win, ``float32`` / null are off; the update and the engine follow the resolved value."""
import pytest
import torch

from masrl.config import TrainerConfig
from masrl.errors import ConfigError
from masrl.models.precision import cpu_has_native_bf16, resolve_autocast
from masrl.training.update import autocast

ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 avx512_vnni\n"
SPR = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8\n"
ZEN3 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 fma\n"


@pytest.mark.parametrize("text, native", [(ZEN4, True), (SPR, True), (ZEN3, False), ("no flags here\n", False)])
def test_native_bf16_is_read_from_the_cpu_flags(tmp_path, text, native):
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    assert cpu_has_native_bf16(str(path)) is native


def test_no_cpuinfo_means_float32(tmp_path):
    assert cpu_has_native_bf16(str(tmp_path / "absent")) is False


def test_explicit_values_win_and_float32_or_null_is_off():
    for device in ("cpu", "cuda", "mps"):
        assert resolve_autocast("bfloat16", device) == "bfloat16"
        assert resolve_autocast("float16", device) == "float16"
        assert resolve_autocast("float32", device) is None
        assert resolve_autocast(None, device) is None
    assert resolve_autocast("auto", "mps") is None


def test_auto_on_cpu_follows_the_flags(monkeypatch):
    import masrl.models.precision as precision

    for native, expected in ((True, "bfloat16"), (False, None)):
        monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda native=native: native)
        assert resolve_autocast("auto", "cpu") == expected
        ctx = autocast(TrainerConfig(autocast="auto"), "cpu")
        with ctx:
            assert torch.is_autocast_enabled("cpu") is native
            if native:
                assert torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_auto_is_the_default_and_bad_values_are_refused():
    assert TrainerConfig().autocast == "auto"
    with autocast(TrainerConfig(autocast="float32"), "cpu"):
        assert not torch.is_autocast_enabled("cpu")
    with autocast(TrainerConfig(autocast=None), "cpu"):
        assert not torch.is_autocast_enabled("cpu")
    with pytest.raises((ValueError, ConfigError), match="autocast"):
        TrainerConfig(autocast="bf16")


def test_the_engine_decodes_under_the_resolved_autocast(monkeypatch):
    """``auto`` decodes under autocast where bf16 is native, for models at least AUTO_BF16_MIN_HIDDEN wide; a
    narrower model decodes in float32 under ``auto`` (faster on a CPU), but under an explicit ``bfloat16``."""
    import masrl.models.precision as precision
    from masrl.models.tiny import build_char_tokenizer, build_tiny_model
    from masrl.rollout.engine import AUTO_BF16_MIN_HIDDEN, TransformersEngine

    def model(hidden):
        return build_tiny_model(build_char_tokenizer(), {"hidden_size": hidden, "num_hidden_layers": 1,
                                                         "num_attention_heads": 2, "num_key_value_heads": 2,
                                                         "intermediate_size": 32}, seed=0)

    wide, narrow = model(AUTO_BF16_MIN_HIDDEN), model(AUTO_BF16_MIN_HIDDEN - 16)
    for native in (True, False):
        monkeypatch.setattr(precision, "cpu_has_native_bf16", lambda native=native: native)
        for m, setting, expected in ((wide, "auto", native), (narrow, "auto", False), (narrow, "bfloat16", True)):
            engine = TransformersEngine(m, eos_token_ids=[1], pad_token_id=0, autocast=setting)
            with engine._precision(m):
                assert torch.is_autocast_enabled("cpu") is expected
                assert torch.is_inference_mode_enabled() is not expected  # no_grad under autocast (cast cache)