import os

import pytest
import torch

# Tests run on 2 shared cores: one intra-op thread avoids OpenMP oversubscription.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def tiny_config_dict(tmp_path, **over):
    """A minimal two-agent config: tiny model, few tokens, 2 RL steps."""
    cfg = {
        "name": "test", "seed": 0, "output_dir": str(tmp_path / "run"),
        "task": {"name": "arithmetic", "params": {"train_size": 64, "test_size": 8, "max_operand": 9}},
        "workflow": {"name": "math_solver_verifier", "params": {"max_loops": 2},
                     "prompts": {"Solver": "Q {question}\n{context}S ", "Verifier": "Q {question}\n{context}V ",
                                 "context": "{text}\n"}},
        "agents": {"Solver": {"policy": "shared", "max_new_tokens": 8},
                   "Verifier": {"policy": "shared", "max_new_tokens": 4}},
        "policies": {"shared": {"model": "tiny", "optim": {"lr": 1e-3},
                                "tiny": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                                         "num_key_value_heads": 2, "intermediate_size": 64,
                                         "max_position_embeddings": 128}}},
        "sft": {"steps": 40, "batch_size": 16, "lr": 1e-2, "teacher": {"error_rate": 0.3}},
        "trainer": {"total_steps": 2, "batch_size": 3, "group_size": 4},
        "eval": {"n": 2, "k": [1, 2], "limit": 3},
        "logging": {"progress": False, "tensorboard": True, "plots": True},
    }
    for key, value in over.items():
        node = cfg
        parts = key.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return cfg


# A 2-layer tiny Llama for engine tests (max 256 positions)
SMALL_TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
              "intermediate_size": 64, "max_position_embeddings": 256}


@pytest.fixture()
def tiny():
    """``(model, tokenizer)``: a fresh :data:`SMALL_TINY` model in eval mode (seed 0) and the char tokenizer."""
    from masrl.models.tiny import build_char_tokenizer, build_tiny_model

    tok = build_char_tokenizer()
    return build_tiny_model(tok, SMALL_TINY, seed=0).eval(), tok


@pytest.fixture
def tiny_cfg(tmp_path):
    return lambda **over: tiny_config_dict(tmp_path, **over)
