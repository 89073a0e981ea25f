"""The optimizer step measures the gradient norm once and clips with it: the clipped gradients are bit-identical
to ``torch.nn.utils.clip_grad_norm_``'s and the logged norm is the one it would return."""
import torch

from masrl.config import config_from_dict
from masrl.trainer import Trainer


def test_clip_reuses_the_logged_norm_and_equals_clip_grad_norm(tiny_cfg):
    clip = 1e-3  # far below the tiny model's first-step gradient norm: the clip is active
    cfg = config_from_dict(tiny_cfg(**{"sft.steps": 0, "policies.shared.optim.grad_clip": clip}))
    with Trainer(cfg, progress=False) as trainer:
        policy = trainer.policies["shared"]
        params = [p for p in policy.model.parameters() if p.requires_grad]
        accumulated: dict[int, torch.Tensor] = {}  # the last accumulation of each gradient = before the clip
        hooks = [p.register_post_accumulate_grad_hook(lambda p: accumulated.__setitem__(id(p), p.grad.clone()))
                 for p in params]
        at_step: list[torch.Tensor | None] = []
        inner = policy.optimizer.step

        def step(*args, **kwargs):
            at_step.extend(p.grad.clone() if p.grad is not None else None for p in params)
            return inner(*args, **kwargs)

        policy.optimizer.step = step
        episodes = trainer.rollout(trainer.source.train[:4], [0, 1, 2, 3], seed=1)
        turns, _, _ = trainer.score_turns(episodes)
        advantages = torch.tensor([1.0 if i % 2 else -1.0 for i in range(len(turns))])
        metrics = trainer.update(turns, advantages)
        for h in hooks:
            h.remove()
    assert at_step, "the optimizer did not step"
    reference = [torch.nn.Parameter(torch.zeros_like(p)) for p in params if id(p) in accumulated]
    for r, p in zip(reference, [p for p in params if id(p) in accumulated]):
        r.grad = accumulated[id(p)].clone()
    norm = torch.nn.utils.clip_grad_norm_(reference, clip)
    assert float(norm) > 10 * clip
    assert metrics["policy/shared/grad_norm"] == float(norm)
    stepped = [g for p, g in zip(params, at_step) if id(p) in accumulated]
    assert len(stepped) == len(reference) and all(g is not None for g in stepped)
    assert all(torch.equal(g, r.grad) for g, r in zip(stepped, reference))
