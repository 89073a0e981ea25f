"""A turn that continues an earlier turn's token ids (``team.extend``), and the math team's transcript mode
(``workflow.params.transcript: true``): ids, prompt text, the end-of-turn token, prefix reuse in the engine,
the errors for chat formats and other vocabularies, and SFT + RL on the transcript."""
import asyncio
import json

import pytest

from masrl.config import config_from_dict
from masrl.errors import ConfigError
from masrl.models.smollm import SMOLLM2_CHAT_TEMPLATE
from masrl.models.tiny import build_char_tokenizer
from masrl.rollout.runner import make_call, run_episodes
from masrl.rollout.scheduler import RolloutScheduler
from masrl.training.policy import build_policy
from masrl.types import Task, Turn
from masrl.workflows.base import Continuation, Team, get_workflow
from masrl.workflows.testing import exact_match_score, run_scripted
from test_tool_chat import _Text, _bpe_tokenizer

TASK = Task(id="t", question="2+3", answer="5")
CUES = {"Solver": "Q {question}\n{context}S ", "Verifier": "Q {question}\n{context}V ", "context": "{text}\n",
        "Solver_cue": "\nS ", "Verifier_cue": "\nV "}
TRANSCRIPT = {"max_loops": 2, "transcript": True}


def _scripted_ids_run(text, replies, *, params=TRANSCRIPT, prompts=CUES, system_prompt=None, cut=()):
    """The math team on scripted replies, prompts encoded by ``text`` (a PolicyText) as in training; replies
    whose index is in ``cut`` end without end-of-sequence (cut at max_new_tokens)."""
    queue = list(replies)

    async def call(agent, prompt):
        ids = text.encode_prompt(prompt, system_prompt)
        i = len(replies) - len(queue)
        reply = queue.pop(0)
        response = text.encode_response(reply)
        if i in cut:
            response = response[:-1]
        return Turn(agent, "p", ids, response, [], reply, text.render_prompt(prompt, system_prompt),
                    truncated=i in cut)

    spec = get_workflow("math_solver_verifier")
    return asyncio.run(spec.fn(TASK, Team(TASK, spec, call, exact_match_score, prompts=prompts, params=params)))


def test_a_continued_prompt_is_the_earlier_prompt_reply_and_cue_ids():
    tok = build_char_tokenizer()
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    episode = _scripted_ids_run(_Text(tok), ["2+3=6\n\\boxed{6}", "<verify>reject</verify>", "\\boxed{5}"])
    s1, v, s2 = episode.turns
    assert [t.agent for t in episode.turns] == ["Solver", "Verifier", "Solver"]
    assert s1.prompt_ids == enc("Q 2+3\nS ")  # the first turn is rendered as without transcript
    assert v.prompt_ids == s1.prompt_ids + s1.response_ids + enc("\nV ")
    assert s2.prompt_ids == v.prompt_ids + v.response_ids + enc("\nS ")
    assert s1.response_ids[-1] == tok.eos_token_id  # the reply's own end-of-turn token stays in the transcript
    for turn in episode.turns:  # the prompt text spells the ids (end-of-sequence included)
        assert turn.prompt_text == tok.decode(turn.prompt_ids, skip_special_tokens=False)
    assert s2.prompt_text == "Q 2+3\nS 2+3=6\n\\boxed{6}</s>\nV <verify>reject</verify></s>\nS "
    assert episode.answer == "\\boxed{5}" and episode.info["verdicts"] == ["reject"]


def test_a_cut_reply_is_closed_with_end_of_sequence_in_the_continuation():
    tok = build_char_tokenizer()
    text = _Text(tok)
    episode = _scripted_ids_run(text, ["2+3=", "<verify>reject</verify>", "\\boxed{5}"], cut={0})
    s1, v, _ = episode.turns
    assert s1.truncated and s1.response_ids[-1] != tok.eos_token_id
    assert v.prompt_ids == s1.prompt_ids + s1.response_ids + [tok.eos_token_id] + \
        tok("\nV ", add_special_tokens=False)["input_ids"]
    assert v.prompt_text == "Q 2+3\nS 2+3=</s>\nV "


def test_bpe_ids_continue_where_re_tokenized_text_would_merge_across_the_reply():
    """A prompt that ends with a space (the quickstart's "S "): re-tokenizing the whole text merges that space
    with the reply's first word (a byte-level BPE's "Ġthe"); the continuation keeps the ids the model saw and
    produced."""
    tok = _bpe_tokenizer(template="{{ messages[-1]['content'] }}")  # a plain-text format: prompt as it is
    prompts = {**CUES, "Solver": "user: {question}\n{context}assistant: ", "Solver_cue": "\nassistant: ",
               "Verifier_cue": "\nuser: check "}
    episode = _scripted_ids_run(_Text(tok), ["the answer is 5", "the answer needs work", "the answer is 5"],
                                prompts=prompts)
    s1, v, s2 = episode.turns
    earlier = s1.prompt_ids + s1.response_ids
    assert v.prompt_ids[:len(earlier)] == earlier and s2.prompt_ids[:len(v.prompt_ids)] == v.prompt_ids
    naive = tok(s1.prompt_text + "the answer is 5", add_special_tokens=False)["input_ids"]
    assert naive != s1.prompt_ids + s1.response_ids[:-1]  # re-tokenizing merges across the reply's start
    assert tok.decode(s2.prompt_ids, skip_special_tokens=False) == s2.prompt_text


def test_transcript_false_renders_the_prompts_as_before():
    replies = {"Solver": ["\\boxed{6}", "\\boxed{5}"], "Verifier": ["<verify>reject</verify>"]}
    off = run_scripted("math_solver_verifier", TASK, replies, prompts=CUES, params={"max_loops": 2})
    assert [t.prompt_text for t in off.turns] == ["Q 2+3\nS ", "Q 2+3\n\\boxed{6}\nV ",
                                                  "Q 2+3\n\\boxed{6}\n<verify>reject</verify>\nS "]
    on = run_scripted("math_solver_verifier", TASK, replies, prompts=CUES, params=TRANSCRIPT)
    assert on.turns[2].prompt_text == "Q 2+3\nS \\boxed{6}\nV <verify>reject</verify>\nS "  # transcript(): no ids
    with pytest.raises(ConfigError, match="transcript must be true or false"):
        run_scripted("math_solver_verifier", TASK, replies, prompts=CUES, params={"transcript": "yes"})


def test_a_chat_template_or_a_system_prompt_cannot_be_continued():
    chat = build_char_tokenizer()
    chat.chat_template = SMOLLM2_CHAT_TEMPLATE  # an instruct model: string prompts are wrapped in chat markers
    with pytest.raises(ConfigError, match="wraps a string prompt in chat markers.*transcript: false"):
        _scripted_ids_run(_Text(chat), ["\\boxed{6}", "<verify>reject</verify>", "\\boxed{5}"])
    with pytest.raises(ConfigError, match="the agent has a system_prompt"):
        _scripted_ids_run(_Text(build_char_tokenizer()), ["\\boxed{6}", "<verify>reject</verify>", "\\boxed{5}"],
                          system_prompt="Be brief.")


def _policies(tiny_cfg, **over):
    cfg = config_from_dict(tiny_cfg(**{"workflow.params": TRANSCRIPT, "workflow.prompts": CUES, **over}))
    names = sorted(cfg.policies)
    policies = {n: build_policy(n, cfg.policies[n], seed=0, max_rollout_batch=32, rollout=cfg.rollout) for n in names}
    return cfg, policies


def _rollout(cfg, policies, tasks):
    scheduler = RolloutScheduler({n: p.engine for n, p in policies.items()})
    call = make_call(policies, cfg.agents, scheduler)
    return run_episodes(get_workflow("math_solver_verifier"), tasks, list(range(len(tasks))), call=call,
                        scheduler=scheduler, score=exact_match_score, prompts=CUES, params=TRANSCRIPT,
                        format_penalty=0.0)


def test_the_engine_reuses_the_transcript_with_identical_tokens_and_logprobs(tiny_cfg):
    """Each continued row prefills only its earlier reply's last token(s) and the cue; the sampled tokens and
    log-probs equal the engine's without the prefix store."""
    tasks = [Task(id=str(i), question=q, answer="0") for i, q in enumerate(["12+13-4+5", "7*3-2*8", "9-1+6-3"] * 2)]
    runs = {}
    for cache in (False, True):
        cfg, policies = _policies(tiny_cfg, **{"rollout.prefix_cache": cache, "agents.Solver.max_new_tokens": 12,
                                               "agents.Verifier.max_new_tokens": 6,
                                               "workflow.params.untagged_verdict": "reject"})
        runs[cache] = (_rollout(cfg, policies, tasks), policies["shared"].engine)
    (plain, plain_engine), (cached, cached_engine) = runs[False], runs[True]
    for a, b in zip(plain, cached):
        assert [t.response_ids for t in a.turns] == [t.response_ids for t in b.turns]
        assert max(abs(x - y) for ta, tb in zip(a.turns, b.turns) for x, y in zip(ta.logprobs, tb.logprobs)) < 1e-5
    turns = [t for ep in cached for t in ep.turns]
    assert len(turns) == 18  # untagged verdicts reject: every episode runs Solver, Verifier, Solver
    assert plain_engine.prefill_tokens == sum(len(t.prompt_ids) for t in turns)
    first = sum(len(t.prompt_ids) for t in turns if t.turn_index == 0)
    continued = [(ep.turns[i - 1], ep.turns[i]) for ep in cached for i in (1, 2)]
    # the stored row of the earlier turn holds its prompt and every reply token but the last
    suffix = sum(len(t.prompt_ids) - len(e.prompt_ids) - len(e.response_ids) + 1 for e, t in continued)
    assert cached_engine.prefill_tokens <= first + suffix
    assert cached_engine.prefill_tokens < 0.35 * plain_engine.prefill_tokens


def test_a_continuation_of_an_over_long_or_refused_turn_or_another_vocabulary(tiny_cfg):
    cfg, policies = _policies(tiny_cfg)
    scheduler = RolloutScheduler({"shared": policies["shared"].engine})
    call = make_call(policies, cfg.agents, scheduler)
    room = policies["shared"].max_positions - cfg.agents["Verifier"].max_new_tokens
    earlier = Turn("Solver", "shared", [5] * (room - 2), [6, 7], [0.0, 0.0], "ab", "x" * (room - 2))
    [turn] = scheduler.run([call("Verifier", Continuation(earlier, "\nV "))])
    assert turn.info["prompt_truncated_from"] == room + 3 and len(turn.prompt_ids) == room  # its end kept
    assert turn.prompt_ids[-5:] == [6, 7] + policies["shared"].tokenizer("\nV ", add_special_tokens=False)["input_ids"]
    refused = Turn("Solver", "shared", [], [], [], "", "x" * 2000, valid=False, info={"refused": "too long"})
    turn = asyncio.run(call("Verifier", Continuation(refused, "\nV ")))
    assert not turn.valid and turn.info["refused"] == "continues a refused turn: too long"
    other = Turn("Solver", "other", [5], [6], [0.0], "a", "x")
    policies["other"] = type("P", (), {"tokenizer": build_char_tokenizer(["<extra>"])})()
    with pytest.raises(ConfigError, match="continues a turn of policy 'other'.*tokenizers differ"):
        asyncio.run(call("Verifier", Continuation(other, "\nV ")))


def test_quickstart_transcript_sft_then_rl(tmp_path):
    """examples/quickstart_transcript.yaml at tiny sizes: SFT demonstrations are collected on the transcript (the
    teacher's traces continue the ids as RL does), then two RL steps run on it."""
    from masrl.config import load_config
    from masrl.trainer import Trainer
    from masrl.training.sft import collect_demonstrations

    cfg = load_config("examples/quickstart_transcript.yaml", [
        "sft.steps=3", "sft.batch_size=8", "trainer.total_steps=2", "trainer.batch_size=2", "trainer.group_size=2",
        "task.params.train_size=16", "task.params.test_size=2", "eval.before_after=false", "eval.every=0",
        "trainer.save_every=0", "logging.tensorboard=false", "logging.plots=false", "logging.progress=false",
        "policies.shared.tiny.hidden_size=32", "policies.shared.tiny.num_hidden_layers=1"])
    assert cfg.workflow.params["transcript"] is True
    with Trainer(cfg, run_dir=tmp_path / "run") as trainer:
        rows = collect_demonstrations(trainer.spec, trainer.source.train[:4], trainer.source.teacher,
                                      policies=trainer.policies, agents=cfg.agents, score=trainer.source.score,
                                      prompts=cfg.workflow.prompts, params=trainer.params)
        eos = trainer.policies["shared"].eos_token_id
        solver, verifier = rows[0], rows[1]
        assert (solver.agent, verifier.agent) == ("Solver", "Verifier") and solver.response_ids[-1] == eos
        cue = trainer.policies["shared"].tokenizer("\nV ", add_special_tokens=False)["input_ids"]
        assert verifier.prompt_ids == solver.prompt_ids + solver.response_ids + cue
        assert trainer.fit()
        last = trainer.rollout(trainer.source.train[:2], [0, 1])
    for ep in last:  # RL turns continue the earlier turn's prompt and reply ids
        for a, b in zip(ep.turns, ep.turns[1:]):
            assert b.prompt_ids[:len(a.prompt_ids) + len(a.response_ids)] == a.prompt_ids + a.response_ids
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in steps if "team/reward" in m] == [1, 2] and any("sft/shared/loss" in m for m in steps)
