"""Every shipped example config validates (a typo in an example would otherwise reach users first)."""
from pathlib import Path

import pytest

from masrl.config import load_config

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


def test_there_are_examples():
    assert len(EXAMPLES) >= 10


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_config_validates(path):
    cfg = load_config(str(path), [])
    assert cfg.agents and cfg.policies
    assert all(a.policy in cfg.policies for a in cfg.agents.values())
