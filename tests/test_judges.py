"""Rewards from an LLM judge or a reward model (masrl.judges): verdict parsing, batching, the remote judge
against a real local HTTP server, a reward model from a tiny config, config errors at load."""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import masrl.judges as judges
from masrl.errors import ConfigError
from masrl.judges.backends import Reply
from masrl.judges.config import JudgeOptions
from masrl.judges.judge import JudgeReward
from masrl.judges.stats import JudgeFailedError, pearson, spearman
from masrl.judges.verdicts import (pairwise_preference, parse_choice, parse_score, parse_yes_no, top_logprob_masses,
                                   verdict_token_ids, yes_share)
from masrl.tasks.rewards import resolve_reward
from masrl.types import Task

TINY = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
        "intermediate_size": 64}
TASK = Task("t1", "What is 2+2?", "4")


class FixedBackend:
    """Replies from a function of the prompt; records every batch it was asked."""

    endpoint = "fixed"

    def __init__(self, reply):
        self.reply, self.batches = reply, []

    def new_step(self):
        pass

    def complete(self, prompts):
        self.batches.append(list(prompts))
        return [Reply(self.reply(p)) for p in prompts]


def make_judge(reply, **options) -> tuple[JudgeReward, FixedBackend]:
    backend = FixedBackend(reply)
    opts = JudgeOptions(model="tiny", **options)
    check = resolve_reward(opts.check) if opts.check else None
    return JudgeReward(opts, backend, check), backend


# ----------------------------------------------------------------------------- parsing

def test_score_parser_maps_the_stated_scale_and_rejects_out_of_range():
    assert parse_score("Score: 7", 1, 10) == pytest.approx(6 / 9)
    assert parse_score("I think 3 of 5. Rating = 5", 1, 5) == 1.0  # the labelled number wins
    assert parse_score("10", 0, 10) == 1.0 and parse_score("0", 0, 10) == 0.0
    assert parse_score("Score: 11", 1, 10) is None
    assert parse_score("no number here", 1, 10) is None


def test_yes_no_and_pairwise_parsers():
    assert parse_yes_no("Yes, it is right") == 1.0 and parse_yes_no("no.") == 0.0
    assert parse_yes_no("nothing") is None and parse_yes_no("yesterday") is None
    assert parse_choice("[[B]] is better") == "B" and parse_choice("Answer A wins") == "A"
    assert parse_choice("[[tie]]") == "tie" and parse_choice("neither") is None
    assert pairwise_preference("A", "B") == 1.0  # preferred in both orders
    assert pairwise_preference("A", "A") == 0.5  # a judge that always picks A: position bias cancels
    assert pairwise_preference("B", "A") == 0.0 and pairwise_preference("A", None) is None


def test_yes_probability_helpers_by_hand():
    import math

    from masrl.models.tiny import build_char_tokenizer

    chars = build_char_tokenizer()  # no word is one token: the first characters, " " (both sides) dropped
    yes, no = verdict_token_ids(chars)
    assert sorted(chars.decode([i]) for i in yes) == ["Y", "y"] and sorted(chars.decode([i]) for i in no) == ["N", "n"]
    words = build_char_tokenizer(["yes", "Yes", "no"])  # one-token words: only those, not their first characters
    yes, no = verdict_token_ids(words)
    assert sorted(words.decode([i]) for i in yes) == ["Yes", "yes"] and [words.decode([i]) for i in no] == ["no"]
    assert yes_share(0.3, 0.1, 0.01) == pytest.approx(0.75)
    assert yes_share(0.004, 0.004, 0.01) is None and yes_share(0.0, 0.0, 0.0) is None
    top = [{"token": " Yes", "logprob": math.log(0.5)}, {"token": "yes", "logprob": math.log(0.1)},
           {"token": "No", "logprob": math.log(0.2)}, {"token": "Maybe", "logprob": math.log(0.15)}]
    assert top_logprob_masses(top) == (pytest.approx(0.6), pytest.approx(0.2))
    from masrl.evaluation.metrics import auc

    # positives 0.35, 0.8 against negatives 0.1, 0.4: 3 of 4 pairs ordered; a tie counts half
    assert auc([0.1, 0.4, 0.35, 0.8], [False, False, True, True]) == 0.75
    assert auc([1.0, 1.0, 0.0], [True, False, False]) == 0.75 and auc([0.5], [True]) is None


def test_yes_prob_verdict_reads_the_backend_probabilities():
    class ProbBackend(FixedBackend):
        def yes_probabilities(self, prompts):
            self.batches.append(list(prompts))
            return [Reply("Yes", p_yes=0.3, p_no=0.1) if "4" in p.split("Answer:")[-1] else
                    Reply("x", p_yes=0.001, p_no=0.002) for p in prompts]

    backend = ProbBackend(None)
    judge = JudgeReward(JudgeOptions(model="tiny", verdict="yes_prob", check="qa_em"), backend,
                        resolve_reward("qa_em"))
    right, odd = judge.score_batch([(TASK, "4"), (TASK, "5")])
    assert right["reward"] == pytest.approx(0.75) and right["correct"] and "P(yes)=0.3000" in right["judge_output"]
    assert odd["reward"] == 0.0 and odd["reason"] == "judge_unparsed"  # 0.3% on yes + no < min_verdict_mass
    assert len(backend.batches) == 1
    metrics = judge.step_metrics()
    assert metrics["judge/unparsed"] == 1 and metrics["judge/score"] == pytest.approx(0.75)


def test_unparsed_verdict_scores_zero_with_reason_and_is_counted():
    judge, _ = make_judge(lambda p: "hmm", verdict="score")
    result = judge(TASK, "4")
    assert result["reward"] == 0.0 and result["reason"] == "judge_unparsed"
    judge2, _ = make_judge(lambda p: "Score: 42", verdict="score", scale=(1, 10))
    assert judge2(TASK, "4")["reason"] == "judge_unparsed"
    with pytest.warns(UserWarning, match="no judge reply of the step had a verdict.*'hmm'"):
        metrics = judge.step_metrics()
    assert metrics["judge/unparsed"] == 1 and metrics["judge/calls"] == 1 and metrics["judge/errors"] == 0
    # an unparsed reply still goes through the rule-based check (the judge's correct flag is False)
    judge3, _ = make_judge(lambda p: "hmm", verdict="yes_no", check="qa_em")
    assert judge3(TASK, "4")["heldout_correct"] is True
    with pytest.warns(UserWarning):
        metrics = judge3.step_metrics()
    assert metrics["judge/heldout_check"] == 1.0 and metrics["judge/heldout_agreement"] == 0.0
    assert "judge/score" not in metrics


def test_pairwise_scores_both_orders_against_the_reference():
    # this judge always prefers the position A: averaged over both orders the answer gets 0.5
    judge, backend = make_judge(lambda p: "[[A]]", verdict="pairwise")
    assert judge(TASK, "5")["reward"] == 0.5
    prompts = backend.batches[0]
    assert len(prompts) == 2 and prompts[0].index("5") < prompts[0].index("4") and \
        prompts[1].index("4") < prompts[1].index("5")
    # a judge that prefers the text "4" wherever it stands
    def prefers_four(p):
        a = p.split("Answer A: ")[1].split("\n")[0]
        return "[[A]]" if a == "4" else "[[B]]"
    judge, _ = make_judge(prefers_four, verdict="pairwise")
    assert judge(TASK, "4")["reward"] == 0.5  # the answer equals the reference: A in both orders
    assert judge(TASK, "5")["reward"] == 0.0



def test_pairwise_against_other_answers_of_the_group_in_both_orders():
    def longer(p):  # prefers the longer answer wherever it stands; a tie on equal lengths
        a, b = p.split("Answer A: ")[1].split("\n")[0], p.split("Answer B: ")[1].split("\n")[0]
        return "[[A]]" if len(a) > len(b) else "[[B]]" if len(b) > len(a) else "[[tie]]"

    judge, backend = make_judge(longer, verdict="pairwise", pairwise_against="group")
    other = Task("t2", "What is 3+3?", "6")
    # group t1: "aaa", "a", "aa" (each meets the next one, cyclically); group t2: "x" alone (against the reference)
    pairs = [(TASK, "aaa"), (TASK, "a"), (other, "x"), (TASK, "aa"), (TASK, None)]
    rewards = [r["reward"] for r in judge.score_batch(pairs)]
    # aaa vs a: won in both orders (1); a vs aa: lost (0); aa vs aaa: lost (0); "x" vs reference "6": tie (0.5)
    assert rewards == [1.0, 0.0, 0.5, 0.0, 0.0]
    prompts = backend.batches[0]
    assert len(prompts) == 8  # 4 comparisons, 2 orders each
    first = [p for p in prompts if "Answer A: aaa\n" in p and "Answer B: a\n" in p]
    swapped = [p for p in prompts if "Answer A: a\n" in p and "Answer B: aaa\n" in p]
    assert len(first) == 1 and len(swapped) == 1
    # two opponents each: aaa beats a and aa (1); a loses both (0); aa beats a, loses to aaa (0.5)
    judge2, backend2 = make_judge(longer, verdict="pairwise", pairwise_against="group", opponents=2)
    assert [r["reward"] for r in judge2.score_batch([(TASK, "aaa"), (TASK, "a"), (TASK, "aa")])] == [1.0, 0.0, 0.5]
    assert len(backend2.batches[0]) == 6  # 3 distinct pairs x 2 orders: a comparison asked twice is judged once
    # a position-biased judge gives every answer 0.5; an opponent equal to the answer is a tie without a call
    biased, backend3 = make_judge(lambda p: "[[A]]", verdict="pairwise", pairwise_against="group")
    assert [r["reward"] for r in biased.score_batch([(TASK, "5"), (TASK, "7"), (TASK, "7")])] == [0.5, 0.5, 0.5]
    assert all("Answer A: 7\nAnswer B: 7" not in p for p in backend3.batches[0])
    with pytest.raises(ConfigError, match="pairwise_against"):
        judges.build_judge({"model": "tiny", "verdict": "pairwise", "pairwise_against": "others"}, {})

# ----------------------------------------------------------------------------- batching, cache, guards

def test_score_batch_is_one_call_with_a_cache_and_matches_one_by_one():
    judge, backend = make_judge(lambda p: "yes" if "Answer: 4" in p else "no", verdict="yes_no", check="qa_em")
    pairs = [(TASK, "4"), (TASK, "5"), (TASK, "4"), (TASK, None)]
    batch = judge.score_batch(pairs)
    assert len(backend.batches) == 1 and len(backend.batches[0]) == 2  # the repeated answer judged once
    assert [r["reward"] for r in batch] == [1.0, 0.0, 1.0, 0.0] and batch[3]["reason"] == "no_answer"
    assert batch[0]["heldout_correct"] is True and batch[1]["heldout_correct"] is False
    fresh, _ = make_judge(lambda p: "yes" if "Answer: 4" in p else "no", verdict="yes_no")
    assert [fresh(t, a)["reward"] for t, a in pairs] == [r["reward"] for r in batch]
    assert batch[3]["heldout_correct"] is False  # no answer: the rule counts it wrong, as avg@n does
    metrics = judge.step_metrics()
    assert metrics["judge/heldout_check"] == 2 / 4 and metrics["judge/heldout_agreement"] == 1.0
    assert metrics["judge/score"] == 2 / 3  # the mean judged reward of the answers with a verdict
    assert judge.step_metrics()["judge/calls"] == 0  # counters start afresh each step


def test_length_correlation_reported():
    judge, _ = make_judge(lambda p: f"Score: {min(len(p.split('Answer: ')[1].split(chr(10))[0]), 10)}",
                          verdict="score", scale=(0, 10))
    judge.score_batch([(TASK, "x" * n) for n in (1, 3, 5, 8)])
    metrics = judge.step_metrics()
    assert metrics["judge/length_corr"] == pytest.approx(1.0) and metrics["judge/length_spearman"] == pytest.approx(1.0)
    assert pearson([1, 2], [1, 2]) is None and spearman([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)


def test_team_finish_defers_to_one_batch_after_the_rollout():
    from masrl.rollout.runner import run_episodes
    from masrl.rollout.scheduler import RolloutScheduler
    from masrl.types import Turn
    from masrl.workflows.base import WorkflowSpec

    async def flow(task, team):
        turn = await team.call("Writer", task.question)
        mid = team.score(turn.text + " (draft)") if team.params.get("mid") else {}  # mid-episode: the per-call path
        return team.finish(answer=turn.text, mid=mid.get("reward"))

    async def call(agent, prompt):
        return Turn(agent=agent, policy="p", prompt_ids=[], response_ids=[], logprobs=[], text="4")

    spec = WorkflowSpec("w", flow, ("Writer",), {})
    tasks = [TASK, Task("t2", "What is 3+3?", "6")]
    for mid in (False, True):
        judge, backend = make_judge(lambda p: "no" if "(draft)" in p else "yes", verdict="yes_no")
        episodes = run_episodes(spec, tasks, [0, 1], call=call, scheduler=RolloutScheduler({}), score=judge,
                                prompts={}, params={"mid": mid}, format_penalty=0.0)
        assert [e.reward for e in episodes] == [1.0, 1.0] and episodes[0].correct
        assert "score_pending" not in episodes[0].info
        # the final answers of both episodes in one batch, after the mid-episode calls (one answer each)
        assert [len(b) for b in backend.batches] == ([1, 1, 2] if mid else [2])
        assert [e.info["mid"] for e in episodes] == ([0.0, 0.0] if mid else [None, None])


def test_evaluation_summary_reports_the_heldout_check_beside_the_judge():
    from masrl.evaluation.summary import summarize_episodes
    from masrl.rollout.runner import run_episodes
    from masrl.rollout.scheduler import RolloutScheduler
    from masrl.types import Turn
    from masrl.workflows.base import WorkflowSpec

    async def flow(task, team):
        turn = await team.call("Writer", task.question)
        return team.finish(answer=turn.text)

    async def call(agent, prompt):  # the team answers "4" to every question
        return Turn(agent=agent, policy="p", prompt_ids=[], response_ids=[], logprobs=[], text="4")

    spec = WorkflowSpec("w", flow, ("Writer",), {})
    tasks = [TASK, TASK, Task("t2", "What is 3+3?", "6"), Task("t2", "What is 3+3?", "6")]
    # a judge that approves every answer; exact match finds 2 of the 4 right
    judge, _ = make_judge(lambda p: "yes", verdict="yes_no", check="qa_em")
    episodes = run_episodes(spec, tasks, [0, 0, 1, 1], call=call, scheduler=RolloutScheduler({}), score=judge,
                            prompts={}, params={}, format_penalty=0.0)
    summary = summarize_episodes(episodes, [1])
    assert summary["avg@n"] == 1.0 and summary["heldout_check"] == 0.5 and summary["heldout_agreement"] == 0.5
    assert summary["judge_score"] == 1.0 and summary["heldout_auc"] == 0.5  # every answer scored 1: ties, chance
    plain, _ = make_judge(lambda p: "yes", verdict="yes_no")  # no check: no held-out keys
    episodes = run_episodes(spec, tasks, [0, 0, 1, 1], call=call, scheduler=RolloutScheduler({}), score=plain,
                            prompts={}, params={}, format_penalty=0.0)
    assert "heldout_check" not in summarize_episodes(episodes, [1])

# ----------------------------------------------------------------------------- the real engine

def test_local_tiny_judge_is_greedy_deterministic_and_batch_equals_one_by_one():
    opts = {"model": "tiny", "tiny": TINY, "verdict": "score", "max_new_tokens": 6, "init_seed": 3}
    judge = judges.build_judge(opts, {})
    answers = ["4", "five", "22", "four or 5"]
    prompts = [judge.prompts(TASK, a)[0] for a in answers]
    batch = [r.text for r in judge.backend.complete(prompts)]
    single = [judge.backend.complete([p])[0].text for p in prompts]
    assert batch == single and all(len(t) > 0 for t in batch)
    assert [r.text for r in judge.backend.complete(prompts)] == batch
    assert not any(p.requires_grad for p in judge.backend.model.parameters())
    assert judges.build_judge(opts, {}) is judge  # the config check and the run share one judge


def test_local_yes_prob_judge_with_a_known_verdict_and_batch_equals_the_unpadded_reference():
    import torch

    judge = judges.build_judge({"model": "tiny", "tiny": TINY, "verdict": "yes_prob", "init_seed": 5}, {})
    backend = judge.backend
    answers = ["4", "five or six", "22"]  # prompts of different lengths: left padding in one batch
    prompts = [judge.prompts(TASK, a)[0] for a in answers]
    batch = backend.yes_probabilities(prompts)
    yes_ids, no_ids = backend.verdict_ids
    for prompt, reply in zip(prompts, batch):  # the reference: one unpadded forward pass per prompt
        with torch.no_grad():
            logits = backend.model(torch.tensor([backend.encode(prompt)])).logits[0, -1]
        probs = torch.softmax(logits.float(), -1)
        assert reply.p_yes == pytest.approx(float(probs[yes_ids].sum()), abs=1e-6)
        assert reply.p_no == pytest.approx(float(probs[no_ids].sum()), abs=1e-6)
    # a judge whose verdict is known: zero weights and a bias of log 3 on "y" give P(y) = 3/Z and 1/Z to each
    # of Y, n, N (Z = vocab + 2), so P(yes) / (P(yes) + P(no)) = 4 / 6 for every prompt
    vocab = backend.model.config.vocab_size
    head = torch.nn.Linear(backend.model.config.hidden_size, vocab, bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[backend.tokenizer.convert_tokens_to_ids("y")] = math.log(3.0)
    backend.model.lm_head = head
    judge.step_metrics()
    results = judge.score_batch([(TASK, a) for a in answers])
    assert [r["reward"] for r in results] == [pytest.approx(2 / 3, abs=1e-6)] * 3
    assert backend.yes_probabilities(prompts[:1])[0].p_no == pytest.approx(2 / (vocab + 2), abs=1e-7)
    strict = JudgeReward(JudgeOptions(model="tiny", verdict="yes_prob", min_verdict_mass=0.99), backend)
    assert strict(TASK, "4")["reason"] == "judge_unparsed"  # 6 / (vocab + 2) of the mass on yes + no


# ----------------------------------------------------------------------------- remote judge

class _Handler(BaseHTTPRequestHandler):
    mode = "ok"
    seen: list = []

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append((self.headers.get("Authorization"), body))
        if self.mode == "slow":
            time.sleep(1.0)
        choice = {"message": {"content": "yes"}}
        if self.mode == "logprobs":  # P(Yes) 0.5 + P(yes) 0.1 against P(No) 0.2 -> 0.75
            choice["logprobs"] = {"content": [{"token": "Yes", "logprob": math.log(0.5), "top_logprobs": [
                {"token": "Yes", "logprob": math.log(0.5)}, {"token": "No", "logprob": math.log(0.2)},
                {"token": " yes", "logprob": math.log(0.1)}, {"token": "The", "logprob": math.log(0.1)}]}]}
        text = "not json at all" if self.mode == "garbage" else json.dumps({"choices": [choice]})
        data = text.encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    pytest.importorskip("httpx", reason="the remote judge needs httpx: pip install 'masrl[judge]'")
    handler = type("H", (_Handler,), {"seen": []})
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd, handler
    httpd.shutdown()
    httpd.server_close()


def _remote_judge(httpd, monkeypatch, verdict="yes_no", **remote):
    monkeypatch.setenv("MASRL_TEST_JUDGE_KEY", "sk-secret-123")
    url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    return judges.build_judge({"remote": {"base_url": url, "model": "judge-1", "api_key_env": "MASRL_TEST_JUDGE_KEY",
                                          **remote}, "verdict": verdict}, {})


def test_remote_judge_success_sends_the_key_only_in_the_header(server, monkeypatch, caplog):
    httpd, handler = server
    caplog.set_level(logging.DEBUG)
    judge = _remote_judge(httpd, monkeypatch)
    results = judge.score_batch([(TASK, "4"), (TASK, "5")])
    assert [r["reward"] for r in results] == [1.0, 1.0]
    assert {h for h, _ in handler.seen} == {"Bearer sk-secret-123"}
    assert handler.seen[0][1]["temperature"] == 0.0 and handler.seen[0][1]["model"] == "judge-1"
    assert judge.step_metrics()["judge/calls"] == 2
    assert "sk-secret-123" not in caplog.text + repr(judge.opts) + repr(results)


def test_remote_judge_timeout_and_garbage_are_errors_and_stop_the_step(server, monkeypatch):
    httpd, handler = server
    handler.mode = "slow"
    judge = _remote_judge(httpd, monkeypatch, timeout_s=0.2, retries=1, backoff_s=0.01)
    result = judge(TASK, "4")
    assert result["reward"] == 0.0 and result["reason"] == "judge_error" and "0.2 s" in result["detail"]
    assert len(handler.seen) == 2  # retried once
    with pytest.raises(JudgeFailedError, match=r"every judge call.*127\.0\.0\.1.*no reply within"):
        judge.step_metrics()
    handler.mode = "garbage"
    judge = _remote_judge(httpd, monkeypatch, retries=3)
    assert judge(TASK, "5")["reason"] == "judge_error"
    with pytest.raises(JudgeFailedError, match="not a chat completion") as err:
        judge.step_metrics()
    assert "sk-secret-123" not in str(err.value)


def test_remote_yes_prob_judge_reads_top_logprobs_and_a_reply_without_them_is_an_error(server, monkeypatch):
    httpd, handler = server
    handler.mode = "logprobs"
    judge = _remote_judge(httpd, monkeypatch, verdict="yes_prob")
    result = judge(TASK, "4")
    assert result["reward"] == pytest.approx(0.75) and result["correct"]
    body = handler.seen[0][1]
    assert (body["logprobs"], body["top_logprobs"], body["max_tokens"]) == (True, 20, 1)
    handler.mode = "ok"  # an endpoint that ignores logprobs: an error, not a silent zero
    judge.step_metrics()
    result = judge(TASK, "5")
    assert result["reason"] == "judge_error" and "no logprobs" in result["detail"]
    with pytest.raises(JudgeFailedError, match="no logprobs"):
        judge.step_metrics()


def test_remote_call_budget_counts_errors_without_stopping_a_partial_step(server, monkeypatch):
    httpd, _ = server
    judge = _remote_judge(httpd, monkeypatch, max_calls_per_step=1, concurrency=1)
    results = judge.score_batch([(TASK, "4"), (TASK, "5")])
    assert sorted(r.get("reason", "ok") for r in results) == ["judge_error", "ok"]
    metrics = judge.step_metrics()
    assert metrics["judge/errors"] == 1 and metrics["judge/calls"] == 2


def test_missing_httpx_names_the_judge_extra(monkeypatch):
    import sys

    from masrl.errors import MissingExtra

    monkeypatch.setitem(sys.modules, "httpx", None)
    # the one form every missing extra has (masrl.errors.missing_extra): an ImportError too, exit 2 at the CLI
    with pytest.raises(MissingExtra, match=r"needs httpx: pip install 'masrl\[judge\]'$"):
        judges.build_judge({"remote": {"base_url": "http://127.0.0.1:9/v1", "model": "m2", "api_key_env": None}}, {})


def test_remote_judge_missing_key_is_a_config_error(monkeypatch):
    monkeypatch.delenv("MASRL_NO_SUCH_KEY", raising=False)
    with pytest.raises(ConfigError, match="MASRL_NO_SUCH_KEY is not set"):
        judges.build_judge({"remote": {"base_url": "http://127.0.0.1:9/v1", "model": "m",
                                       "api_key_env": "MASRL_NO_SUCH_KEY"}}, {})


# ----------------------------------------------------------------------------- reward model

@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from masrl.models.tiny import build_char_tokenizer

    path = tmp_path_factory.mktemp("rm")
    tokenizer = build_char_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, num_labels=1, **TINY)
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.parametrize("normalize", ["sigmoid", "none", "minmax"])
def test_reward_model_batch_equals_one_by_one_and_normalizes(reward_model_dir, normalize):
    import math

    rm = judges.build_reward_model({"path": str(reward_model_dir), "normalize": normalize, "batch_size": 3}, {})
    answers = ["4", "the answer is four", "5", "x" * 40, "22"]
    batch = rm.score_batch([(TASK, a) for a in answers])
    logits = [r["rm_logit"] for r in batch]
    single = [rm.logits([rm.encode(TASK, a)])[0] for a in answers]
    assert max(abs(a - b) for a, b in zip(logits, single)) < 1e-6
    assert len(set(round(x, 6) for x in logits)) > 1
    rewards = [r["reward"] for r in batch]
    if normalize == "sigmoid":
        assert rewards == pytest.approx([1 / (1 + math.exp(-x)) for x in logits])
    elif normalize == "none":
        assert rewards == pytest.approx(logits)
    else:
        assert min(rewards) == 0.0 and max(rewards) == 1.0
    assert not any(p.requires_grad for p in rm.model.parameters())


def test_reward_model_missing_path_is_one_clear_error(tmp_path):
    from masrl.models.hub import ModelLoadError

    with pytest.raises(ModelLoadError, match="task.params.reward.model.path"):
        judges.build_reward_model({"path": str(tmp_path / "nope")}, {})


# ----------------------------------------------------------------------------- config errors at load

@pytest.mark.parametrize("options, message", [
    ({"model": "tiny", "template": "{question} {answer} {colour}"}, r"unknown field\(s\) \['colour'\]"),
    ({"model": "tiny", "verdict": "pairwise", "template": "{question} {answer_a}"}, "missing field"),
    ({"model": "tiny", "verdict": "maybe"}, "judge.verdict"),
    ({"model": "tiny", "temperature": 1.0}, "judge.temperature: unknown option"),
    ({}, "exactly one of model"),
    ({"model": "tiny", "scale": [5, 1]}, "lo < hi"),
])
def test_judge_config_errors_name_the_key(options, message):
    with pytest.raises(ConfigError, match=message):
        resolve_reward({"judge": options}, {})


def test_unknown_reward_kind_and_missing_judge_model(tmp_path):
    from masrl.errors import UserInputError

    with pytest.raises(ConfigError, match="unknown reward 'oracle'; known: .*judge, math, model"):
        resolve_reward({"oracle": {}}, {})
    with pytest.raises(UserInputError, match="task.params.reward.judge.model"):
        resolve_reward({"judge": {"model": str(tmp_path / "no_model")}}, {})


def test_bad_judge_template_in_a_config_exits_2_with_one_line():
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "judge_kb_team.yaml"
    out = subprocess.run([sys.executable, "-m", "masrl", "config", "show", str(example),
                          "task.params.reward.judge.model=tiny",
                          "task.params.reward.judge.template={question} {answr}"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "answr" in out.stderr and "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    ok = subprocess.run([sys.executable, "-m", "masrl", "config", "show", str(example),
                         "task.params.reward.judge.model=tiny"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr


def test_a_step_where_every_judge_call_fails_stops_the_run(tmp_path, monkeypatch):
    import socket
    import subprocess
    import sys

    import yaml

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": str(i + 1)}) + "\n" for i in range(4)))
    remote = {"base_url": f"http://127.0.0.1:{port}/v1", "model": "m", "api_key_env": "MASRL_TEST_JUDGE_KEY",
              "retries": 0, "timeout_s": 2}
    cfg = {"name": "judge-fails", "output_dir": str(tmp_path / "run"),
           "task": {"name": "dataset", "params": {"train": str(data), "reward": {"judge": {"remote": remote}}}},
           "workflow": {"name": "single"}, "agents": {"Solver": {"policy": "p", "max_new_tokens": 4}},
           "policies": {"p": {"model": "tiny", "tiny": TINY}}, "logging": {"progress": False},
           "trainer": {"total_steps": 1, "batch_size": 2, "group_size": 2}, "eval": {"every": 0}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**__import__("os").environ, "MASRL_TEST_JUDGE_KEY": "sk-secret-456"}
    out = subprocess.run([sys.executable, "-m", "masrl", "train", str(path)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert "every judge call of the step failed" in last and f"127.0.0.1:{port}" in last, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "sk-secret-456" not in out.stderr + out.stdout
    written = "".join(p.read_text(errors="replace") for p in (tmp_path / "run").rglob("*") if p.is_file())
    assert "sk-secret-456" not in written


# ----------------------------------------------------------------------------- the run report

def test_judge_summary_by_hand_and_its_table():
    from masrl.judges.report import judge_report_lines, judge_summary

    def step(i, score, check, corr):
        return {"step": i, "phase": "train", "judge/calls": 10.0, "judge/errors": float(i == 2),
                "judge/unparsed": 1.0, "perf/judge_seconds": 1.0, "perf/step_seconds": 4.0, "judge/score": score,
                "judge/heldout_check": check, "judge/heldout_agreement": 0.5, "judge/length_corr": corr,
                "judge/heldout_auc": 0.6}

    records = [{"step": 0, "phase": "eval", "eval/test/avg@n": 0.1}, step(1, 0.2, 0.4, 0.1), step(2, 0.4, 0.4, 0.3),
               step(3, 0.6, 0.2, 0.5), step(4, 0.8, 0.2, 0.7), step(4, 0.9, 0.0, 0.9)]  # step 4 logged twice
    history = {"sft": {"avg@n": 0.25, "heldout_check": 0.5, "heldout_agreement": 0.75, "judge_score": 0.3,
                       "heldout_auc": 0.625},
               "final": {"avg@n": 0.75, "heldout_check": 0.25, "heldout_agreement": 0.5}}
    s = judge_summary(records, history)
    assert (s["steps"], s["calls"], s["errors"], s["unparsed"], s["judge_seconds"]) == (4, 40.0, 1.0, 4.0, 4.0)
    assert s["share_of_step_time"] == 0.25 and s["length_corr_mean"] == pytest.approx((0.1 + 0.3 + 0.5 + 0.9) / 4)
    assert s["window"] == 2 and s["first_steps"]["score"] == pytest.approx(0.3)
    assert s["last_steps"]["score"] == pytest.approx(0.75) and s["last_steps"]["heldout_check"] == pytest.approx(0.1)
    md = "\n".join(judge_report_lines(s, sft_steps=100))
    assert "| 4 | 40 | 1 | 4 | 4.0 s | 25.0% | 0.450 / – |" in md
    assert "| after SFT | 25.0% | 0.300 | 50.0% | – | 75.0% | – | – | 0.625 |" in md
    assert "| after RL | 75.0% | – | 25.0% | – | 50.0% | – | – | – |" in md  # no score or AUC recorded
    assert "| last 2 | 0.750 | 10.0% | – | 50.0% | – | – | 0.600 | 0.700 |" in md  # corr (0.5 + 0.9) / 2
    assert s["constant"] is None and "Warning" not in md
    assert judge_summary([{"step": 1, "phase": "train", "team/reward": 1.0}], {}) is None
    assert judge_report_lines(None, 0) == []


def test_judge_agreement_separates_right_and_wrong_answers():
    from masrl.evaluation.metrics import judge_agreement

    a = judge_agreement([True, False, False, True, False], [True, True, False, False, False])
    assert a == {"approve_rate": 0.4, "agreement": 0.6, "agreement_right": 0.5, "agreement_wrong": 2 / 3}
    none = judge_agreement([False] * 4, [True, False, False, False])  # approves nothing: 75% "agreement"
    assert none["agreement"] == 0.75 and none["agreement_right"] == 0.0 and none["agreement_wrong"] == 1.0
    assert judge_agreement([], []) == {} and "agreement_wrong" not in judge_agreement([True], [True])


def test_a_judge_that_approves_nothing_is_reported_as_constant():
    """The report states the approve rate and both sides of the agreement, and warns in plain words."""
    from masrl.judges.report import judge_report_lines, judge_summary

    records = [{"step": i, "phase": "train", "judge/calls": 8.0, "judge/score": 0.0, "judge/approve_rate": 0.0,
                "judge/heldout_agreement": 1.0, "judge/heldout_agreement_wrong": 1.0, "judge/heldout_check": 0.0}
               for i in (1, 2)]
    history = {"final": {"avg@n": 0.0, "heldout_check": 0.0, "judge_approve_rate": 0.0, "heldout_agreement": 1.0,
                         "heldout_agreement_wrong": 1.0}}
    s = judge_summary(records, history)
    md = "\n".join(judge_report_lines(s, sft_steps=0))
    assert s["constant"] and "approved no answer" in s["constant"] and "constant" in s["constant"]
    assert md.index("Warning: the judge approved no answer") < md.index("| RL steps |")  # atop the section
    assert "| 0.0% | 100.0% | – | 100.0% |" in md  # approves, agrees, on right (no right answers), on wrong


def test_a_judged_run_reports_the_judge_in_report_md(tmp_path):
    import subprocess
    import sys

    import yaml

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": str(i + 1)}) + "\n" for i in range(4)))
    judge = {"model": "tiny", "tiny": TINY, "verdict": "yes_no", "max_new_tokens": 2, "check": "qa_em"}
    cfg = {"name": "judged", "output_dir": str(tmp_path / "run"),
           "task": {"name": "dataset", "params": {"train": str(data), "test": str(data), "reward": {"judge": judge}}},
           "workflow": {"name": "single"}, "agents": {"Solver": {"policy": "p", "max_new_tokens": 4}},
           "policies": {"p": {"model": "tiny", "tiny": TINY}}, "logging": {"progress": False, "plots": False},
           "trainer": {"total_steps": 2, "batch_size": 2, "group_size": 2}, "eval": {"n": 2, "k": [1]}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = subprocess.run([sys.executable, "-m", "masrl", "train", str(path)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    md = (tmp_path / "run" / "report.md").read_text()
    report = json.loads((tmp_path / "run" / "report.json").read_text())
    j = report["judge"]
    assert j["steps"] == 2 and j["unparsed"] >= j["calls"] >= 1  # a random tiny judge: no verdicts
    assert set(j["eval"]) == {"sft", "final"} and "heldout_check" in report["eval"]["final"]
    assert "## Judge" in md and "| before RL |" in md and "held-out check" in md
    assert j["eval"]["final"]["approve_rate"] == 0.0 and "Warning: the judge approved no answer" in md  # no verdicts


def test_the_trainer_judges_a_rollout_in_one_batch_and_never_the_sft_demonstrations(tmp_path):
    # the trainer wraps every score in the reward contract (GuardedScore): the wrapper keeps score_batch
    from masrl.config import load_config
    from masrl.usercode.guard import GuardedScore, RewardLedger
    from masrl.trainer import Trainer
    from masrl.training.sft import collect_demonstrations
    from masrl.workflows.batch_score import scores_in_batches

    cfg = load_config("examples/judge_kb_team.yaml", [
        "task.params.reward.judge.model=tiny", "task.params.reward.judge.max_new_tokens=2",
        "sft.steps=0", "trainer.total_steps=1", "trainer.batch_size=2", "trainer.group_size=2",
        "eval.before_after=false", "eval.every=0", "trainer.save_every=0", "logging.tensorboard=false",
        "logging.plots=false", "logging.progress=false",
        "policies.team.tiny.hidden_size=32", "policies.team.tiny.num_hidden_layers=1"])
    with Trainer(cfg, run_dir=tmp_path / "run") as trainer:
        judge = trainer.source.score
        batches = []
        complete = judge.backend.complete
        judge.backend.complete = lambda prompts: batches.append(len(prompts)) or complete(prompts)
        assert scores_in_batches(GuardedScore(judge))
        rows = collect_demonstrations(trainer.spec, trainer.source.train[:3], trainer.source.teacher,
                                      policies=trainer.policies, agents=cfg.agents, score=GuardedScore(judge),
                                      prompts=cfg.workflow.prompts, params=trainer.params)
        assert rows and batches == []  # the rows carry no reward: no judge call
    # the rollout as the trainer runs it (run_episodes with the guarded score): one batch once the episodes are done
    from masrl.rollout.runner import run_episodes
    from masrl.rollout.scheduler import RolloutScheduler
    from masrl.types import Turn
    from masrl.workflows.base import WorkflowSpec

    async def flow(task, team):
        turn = await team.call("Writer", task.question)
        return team.finish(answer=turn.text + task.id)

    async def call(agent, prompt):
        return Turn(agent=agent, policy="p", prompt_ids=[], response_ids=[], logprobs=[], text="4")

    judge, backend = make_judge(lambda p: "yes", verdict="yes_no", check="qa_em")
    tasks = [Task(f"t{i}", f"{i}+1?", str(i + 1)) for i in range(3)]
    episodes = run_episodes(WorkflowSpec("w", flow, ("Writer",), {}), tasks, [0, 1, 2], call=call,
                            scheduler=RolloutScheduler({}), score=GuardedScore(judge, RewardLedger()), prompts={},
                            params={}, format_penalty=0.0)
    assert [len(b) for b in backend.batches] == [3] and [e.reward for e in episodes] == [1.0] * 3
    assert all("score_pending" not in e.info and "heldout_correct" in e.info for e in episodes)


def test_guarded_score_batch_keeps_the_reward_contract():
    from masrl.usercode.guard import GuardedScore, RewardLedger

    judge, _ = make_judge(lambda p: "yes", verdict="yes_no")
    ledger = RewardLedger()
    guarded = GuardedScore(judge, ledger)
    assert [r["reward"] for r in guarded.score_batch([(TASK, "4"), (TASK, None)])] == [1.0, 0.0]
    assert not hasattr(GuardedScore(lambda t, a: {"reward": 1.0}), "score_batch")  # a plain reward: one by one

    class Broken:
        def __call__(self, task, answer):
            return {"reward": 0.0}

        def score_batch(self, pairs):
            if len(pairs) > 1:
                raise RuntimeError("judge down")
            return [{"reward": float("nan")}]

    guarded = GuardedScore(Broken(), ledger)
    down = guarded.score_batch([(TASK, "4"), (TASK, "5")])
    assert [(r["reward"], r["reason"]) for r in down] == [(0.0, "score_error")] * 2 and "judge down" in down[0]["detail"]
    assert guarded.score_batch([(TASK, "4")])[0]["reason"] == "score_error"  # a non-finite reward
    counts = ledger.take()
    assert counts.calls == 5 and counts.failed == 3


def test_a_judges_failure_share_is_configurable_as_every_other_kinds():
    from masrl.judges.config import JudgeOptions, RewardModelOptions
    from masrl.judges.stats import JudgeStats

    assert JudgeOptions(model="tiny").max_error_share == 1.0 and RewardModelOptions(path="x").max_error_share == 1.0
    with pytest.raises(ValueError, match="max_error_share"):
        JudgeOptions(model="tiny", max_error_share=0.0)

    def step(max_share: float) -> JudgeStats:
        stats = JudgeStats("http://judge", max_share=max_share)
        stats.calls = 4
        stats.error("HTTP 500 from the judge")
        stats.error("no reply within 1 s", timeout=True)
        return stats

    assert step(1.0).pop()["usercode/judge/errors"] == 1.0  # 2 of 4 failed: under the default share, counted
    with pytest.raises(JudgeFailedError, match=r"at least 0.5 of the judge calls.*4 calls.*HTTP 500"):
        step(0.5).pop()
