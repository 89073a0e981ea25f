"""The policy protocol (masrl.training.policy.PolicyProtocol): the local policy and the Ray runtime's policy both
implement it, and checkpoints go through its methods only (a policy that is neither class saves and loads)."""
from __future__ import annotations

import dataclasses
import typing
from types import SimpleNamespace

import torch

from masrl.config import PolicyConfig
from masrl.runtime.ray_runtime import RayPolicy, RemoteEngine
from masrl.training.checkpoint import load_checkpoint, save_checkpoint
from masrl.training.policy import Policy, PolicyProtocol, build_policy

TINY = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
        "intermediate_size": 64, "max_position_embeddings": 128}


def _members() -> set[str]:
    return {name for name in dir(PolicyProtocol) if not name.startswith("_")} | \
        set(typing.get_type_hints(PolicyProtocol))


def _missing(cls) -> list[str]:
    """Protocol members the class neither defines nor declares as a dataclass field."""
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return sorted(m for m in _members() if m not in fields and not hasattr(cls, m))


def test_both_policy_classes_have_every_member_of_the_protocol():
    assert {"checkpoint_state", "restore_state", "save_sharded", "load_sharded", "sharded_checkpoint",
            "optimizer", "name", "cfg"} <= _members()
    assert _missing(Policy) == []
    assert _missing(RayPolicy) == []

    half = type("Half", (), {m: None for m in _members() - {"checkpoint_state"}})
    assert _missing(half) == ["checkpoint_state"]  # a class without one of them is caught


def test_local_and_ray_policy_instances_are_policies():
    local = build_policy("p", PolicyConfig(tiny=TINY), seed=0, max_rollout_batch=4)
    assert isinstance(local, PolicyProtocol) and not local.sharded_checkpoint
    for strategy, sharded in (("replica", False), ("fsdp", True)):
        group = SimpleNamespace(runtime=SimpleNamespace(cfg=SimpleNamespace(runtime=SimpleNamespace(strategy=strategy))))
        remote = RayPolicy(name="p", cfg=local.cfg, tokenizer=local.tokenizer, engine=RemoteEngine(group),
                           group=group, max_positions=128)
        assert isinstance(remote, PolicyProtocol) and remote.sharded_checkpoint is sharded
    assert not isinstance(SimpleNamespace(name="p", cfg=local.cfg), PolicyProtocol)


class _Relay:
    """A policy that is neither class: it relays the protocol's calls to a local policy and records them."""

    def __init__(self, inner: Policy):
        self.inner, self.calls = inner, []
        self.name, self.cfg, self.tokenizer, self.engine = inner.name, inner.cfg, inner.tokenizer, inner.engine
        self.agents, self.adapter_of, self.optimizer, self.max_positions = [], {}, inner.optimizer, 128
        self.sharded_checkpoint = False

    def checkpoint_state(self):
        self.calls.append("checkpoint_state")
        return self.inner.checkpoint_state()

    def restore_state(self, weights, opt_tensors, opt_meta, where):
        self.calls.append("restore_state")
        self.inner.restore_state(weights, opt_tensors, opt_meta, where)

    def save_sharded(self, folder):
        raise AssertionError("not sharded")

    def load_sharded(self, folder, optimizer_meta, where):
        raise AssertionError("not sharded")

    adapter, encode_prompt, encode_response, decode = (lambda self, *a: None,) * 4


def test_a_checkpoint_round_trip_goes_through_the_protocol(tmp_path):
    policy = build_policy("p", PolicyConfig(tiny=TINY, optim={"lr": 1e-2}), seed=0, max_rollout_batch=4)
    params = [p for p in policy.model.parameters() if p.requires_grad]
    sum(p.sum() for p in params).backward()
    policy.optimizer.step()  # optimizer state to save
    relay = _Relay(policy)
    assert isinstance(relay, PolicyProtocol)
    saved = {n: p.detach().clone() for n, p in policy.model.named_parameters()}
    exp_avg = policy.optimizer.state[params[0]]["exp_avg"].clone()
    save_checkpoint(tmp_path, 1, {"p": relay}, {"history": {}})
    with torch.no_grad():
        for p in params:
            p.add_(1.0)
    policy.optimizer.state[params[0]]["exp_avg"].zero_()
    state = load_checkpoint(tmp_path / "checkpoints" / "step_1", {"p": relay})
    assert state["step"] == 1 and relay.calls == ["checkpoint_state", "restore_state"]
    for n, p in policy.model.named_parameters():
        assert torch.equal(p, saved[n]), n
    assert torch.equal(policy.optimizer.state[params[0]]["exp_avg"], exp_avg)
