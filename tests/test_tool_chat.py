"""team.chat: an agent's conversation rendered with the tokenizer's chat template (tools included),
and the call loop model -> tool calls -> tool messages -> model, with its validity rules and cap."""
import time

import pytest

from masrl.config import PolicyConfig
from masrl.models.tiny import build_char_tokenizer
from masrl.tools import Tool, calculator, render_tool_call, tool_schemas, as_tools
from masrl.tools.chat_format import FALLBACK_CHAT_TEMPLATE, ChatPrompt, render_chat
from masrl.training.policy import PolicyText
from masrl.types import Task, Turn
from masrl.workflows.base import Team, get_workflow, register_workflow
from masrl.workflows.parsing import extract_boxed
from masrl.workflows.testing import exact_match_score, run_scripted

# The Qwen2.5 chat template's tool parts (system block listing <tools>, <tool_response> in user turns)
QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or (message.role == 'assistant') %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' }}{{- message.content }}{{- '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHAT_TOKENS = ["<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TASK = Task("t1", "What is (12+30)*7?", "294")
CALL = render_tool_call("calculator", {"expression": "(12+30)*7"})


@register_workflow("_test_calc_chat", agents=("Solver",), prompts={})
async def calc_chat(task: Task, team: Team):
    messages = [{"role": "user", "content": task.question}]
    result = await team.chat("Solver", messages, tools=[calculator, *team.params.get("more_tools", [])],
                             **team.params.get("chat", {}))
    return team.finish(extract_boxed(result.text), stop=result.stop, messages=messages,
                       results=[(r.name, r.status, r.content) for r in result.results])


def _run(replies, **params):
    return run_scripted("_test_calc_chat", TASK, {"Solver": replies}, params=params)


def test_call_loop_runs_the_tool_and_feeds_the_result_back():
    episode = _run([f"Let me compute. {CALL}", "The result is \\boxed{294}."])
    assert episode.correct and episode.info["stop"] == "answer"
    assert [m["role"] for m in episode.info["messages"]] == ["user", "assistant", "tool", "assistant"]
    assert episode.info["messages"][2] == {"role": "tool", "name": "calculator", "content": "294"}
    assert [t.valid for t in episode.turns] == [True, True]
    assert episode.turns[0].info["tool_calls"] == [{"name": "calculator", "status": "ok"}]
    assert "tool: 294" in episode.turns[1].prompt_text  # the second call saw the result


@pytest.mark.parametrize("bad, error", [
    ('<tool_call>{"name": "calculator", "arguments": {"expression": </tool_call>', "Error: malformed JSON"),
    (render_tool_call("calc", {"expression": "1"}), "Error: unknown tool 'calc'; tools: ['calculator']"),
    (render_tool_call("calculator", {"expr": "1"}), "Error: bad arguments for 'calculator': missing required"),
])
def test_a_malformed_call_is_an_error_message_and_an_invalid_turn(bad, error):
    episode = _run([bad, CALL, "\\boxed{294}"])
    assert [t.valid for t in episode.turns] == [False, True, True]
    assert episode.info["messages"][2]["content"].startswith(error)
    assert episode.correct  # the model could recover; only the malformed turn is penalized


def test_a_tool_that_fails_or_times_out_is_reported_but_the_turn_stays_valid():
    def slow(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        time.sleep(seconds)
        return "done"

    t0 = time.perf_counter()
    episode = _run([render_tool_call("slow", {"seconds": 5}) + render_tool_call("calculator", {"expression": "1/0"}),
                    "\\boxed{294}"], more_tools=[Tool(slow)], chat={"timeout_s": 0.2})
    assert time.perf_counter() - t0 < 3
    assert episode.info["results"] == [("slow", "timeout", "Error: slow timed out after 0.2 s"),
                                       ("calculator", "error", "Error: CalculatorError: division by zero")]
    assert all(t.valid for t in episode.turns)


def test_the_episode_cap_on_tool_calls_ends_the_loop():
    episode = _run([CALL + CALL, CALL + CALL, "\\boxed{294}"], max_tool_calls=3)
    assert episode.info["stop"] == "call_limit" and len(episode.turns) == 2
    assert len(episode.info["results"]) == 3 and episode.turns[1].info["tool_call_limit"]
    assert episode.answer is None


class _Text(PolicyText):  # the real prompt rendering of a policy, without a model
    def __init__(self, tokenizer, **cfg):
        self.tokenizer, self.cfg, self.adapter_of = tokenizer, PolicyConfig(**cfg), {}


def _encoding_run(tokenizer, replies, system_prompt=None, encode_reply=None):
    """Run the workflow with scripted replies, prompts encoded by PolicyText as in training; ``encode_reply``:
    the reply's ids as the model generated them (default: the tokenizer's ids + end-of-sequence)."""
    text = _Text(tokenizer)
    queue = list(replies)

    async def call(agent, prompt):
        ids = text.encode_prompt(prompt, system_prompt)
        reply = queue.pop(0)
        response = encode_reply(reply) if encode_reply else text.encode_response(reply)
        return Turn(agent, "p", ids, response, [], reply, text.render_prompt(prompt, system_prompt))

    import asyncio

    spec = get_workflow("_test_calc_chat")
    return asyncio.run(spec.fn(TASK, Team(TASK, spec, call, exact_match_score)))


def test_history_rendering_equals_the_tokenizers_chat_template_with_tools():
    tok = build_char_tokenizer(CHAT_TOKENS)
    tok.chat_template = QWEN_STYLE_TEMPLATE
    tok.eos_token = "<|im_end|>"
    episode = _encoding_run(tok, [f"Compute.\n{CALL}", "\\boxed{294}"], system_prompt="Be brief.")
    messages = [{"role": "system", "content": "Be brief."}] + episode.info["messages"]
    schemas = tool_schemas(as_tools([calculator]))
    prompts = [messages[:2], messages[:4]]  # before each assistant reply
    for turn, shown in zip(episode.turns, prompts):
        expected = tok.apply_chat_template(shown, tools=schemas, add_generation_prompt=True, tokenize=False)
        assert turn.prompt_text == expected
        assert turn.prompt_ids == tok(expected, add_special_tokens=False)["input_ids"]
    assert "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"calculator\"" in episode.turns[0].prompt_text
    assert "<|im_start|>user\n<tool_response>\n294\n</tool_response><|im_end|>\n<|im_start|>assistant\n" \
        in episode.turns[1].prompt_text
    # the earlier prompt and the reply (ending with the end-of-turn token) are a token prefix of the next prompt
    first, second = episode.turns
    assert second.prompt_ids[:len(first.prompt_ids) + len(first.response_ids)] == first.prompt_ids + first.response_ids
    # so the two turns train as one sequence, the tool output masked out of the loss
    from masrl.training.conversation import merge_extending_rows
    from masrl.training.update import Row

    [row] = merge_extending_rows([Row(t.agent, t.prompt_ids, t.response_ids, [0.0] * len(t.response_ids), 1.0)
                                  for t in episode.turns])
    gap = [i for i, m in zip(row.response_ids, row.loss_mask) if not m]
    assert tok.decode(gap) == "\n<|im_start|>user\n<tool_response>\n294\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode([i for i, m in zip(row.response_ids, row.loss_mask) if m]) == \
        f"Compute.\n{CALL}<|im_end|>\\boxed{{294}}<|im_end|>"


def test_tiny_template_without_tool_support_uses_the_terse_fallback():
    tok = build_char_tokenizer()
    messages = [{"role": "user", "content": "Q: 2+3?"}, {"role": "assistant", "content": CALL},
                {"role": "tool", "name": "calculator", "content": "5"}]
    schemas = tool_schemas(as_tools([calculator]))
    assert render_chat(tok, messages, schemas) == f"Tools: calculator(expression)\nQ: 2+3?{CALL}</s><tool_response>5</tool_response>"
    assert render_chat(tok, messages[:1], schemas) == tok.apply_chat_template(
        messages[:1], tools=schemas, chat_template=FALLBACK_CHAT_TEMPLATE, add_generation_prompt=True, tokenize=False)
    plain = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}]
    assert render_chat(tok, plain) == tok.apply_chat_template(plain, tokenize=False, add_generation_prompt=True) == "S\nQ"
    text = _Text(tok)  # a string prompt renders exactly as before team.chat existed
    assert text.encode_prompt("Q", "S") == tok("S\nQ", add_special_tokens=False)["input_ids"]
    assert text.render_prompt(ChatPrompt(plain[1:]), "S") == "S\nQ"


def test_chat_through_the_rollout_engine_records_real_turns():
    from masrl.config import AgentConfig
    from masrl.rollout.runner import make_call, run_episodes
    from masrl.rollout.scheduler import RolloutScheduler
    from masrl.training.policy import build_policy

    tiny = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
            "intermediate_size": 64, "max_position_embeddings": 256}
    policy = build_policy("p", PolicyConfig(tiny=tiny), seed=0, max_rollout_batch=4)
    agents = {"Solver": AgentConfig(policy="p", max_new_tokens=12)}
    scheduler = RolloutScheduler({"p": policy.engine})
    spec = get_workflow("_test_calc_chat")
    episodes = run_episodes(spec, [TASK, TASK], [0, 0], call=make_call({"p": policy}, agents, scheduler),
                            scheduler=scheduler, score=exact_match_score, prompts={}, params={}, format_penalty=0.1)
    for e in episodes:
        first = e.turns[0]
        expected = f"Tools: calculator(expression)\n{TASK.question}"
        assert first.prompt_text == expected
        assert first.prompt_ids == policy.tokenizer(expected, add_special_tokens=False)["input_ids"]
        assert 0 < len(first.response_ids) == len(first.logprobs)
        assert e.info["messages"][1] == {"role": "assistant", "content": first.text}
    # a conversation too long for the context is refused before tokenizing, like a long prompt string
    [huge] = run_episodes(spec, [Task("big", "7*" * 5000 + "1", "1")], [0], call=make_call({"p": policy}, agents, scheduler),
                          scheduler=scheduler, score=exact_match_score, prompts={}, params={}, format_penalty=0.1)
    [turn] = huge.turns
    assert not turn.valid and turn.response_ids == [] and "cannot fit the 256-token context" in turn.info["refused"]


def test_the_docs_example_runs():
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "workflows.md").read_text()
    section = doc[doc.index("## Agents with tools"):]
    code = section[section.index("```python\n") + len("```python\n"):section.index("```\n", section.index("```python"))]
    namespace: dict = {}
    exec(compile(code, "docs/workflows.md", "exec"), namespace)
    call = render_tool_call("convert", {"amount": 3, "unit": "km"})
    episode = run_scripted("tool_solver", Task("d", "How many metres are 3 km?", "3000"),
                           {"Solver": [call, render_tool_call("calculator", {"expression": "3000.0"}), "\\boxed{3000}"]})
    assert episode.correct and episode.info["tool_calls"] == 2
    assert episode.turns[1].prompt_text.endswith("tool: 3000.0")


def test_trainer_merges_an_agents_conversation_with_the_same_update(tmp_path):
    """trainer.merge_conversations: the chat's two turns become one masked row; the update is the same."""
    import torch
    from conftest import tiny_config_dict

    from masrl.config import config_from_dict
    from masrl.trainer import Trainer

    params_after = []
    for merge in (False, True):
        data = tiny_config_dict(tmp_path / str(merge), **{"sft.steps": 0, "trainer.merge_conversations": merge,
                                                          "policies.shared.optim.weight_decay": 0.0,
                                                          "trainer.autocast": "float32"})
        trainer = Trainer(config_from_dict(data))
        policy = trainer.policies["shared"]
        turns = _encoding_run(policy.tokenizer, [f"Compute.\n{CALL}", "\\boxed{294}"]).turns
        assert turns[1].prompt_text.startswith(turns[0].prompt_text + turns[0].text + "</s><tool_response>294")
        for t in turns:
            t.agent, t.policy, t.logprobs = "Solver", "shared", [-2.0] * len(t.response_ids)
        before = [p.detach().clone() for p in policy.trainable_parameters()]
        metrics = trainer.update(turns, torch.tensor([1.0, 1.0]))
        assert metrics["policy/shared/tokens"] == sum(len(t.response_ids) for t in turns), metrics
        assert metrics["policy/shared/rows"] == (1.0 if merge else 2.0)
        params_after.append([p.detach().clone() for p in policy.trainable_parameters()])
        assert any(not torch.equal(a, b) for a, b in zip(before, params_after[-1]))
    for a, b in zip(*params_after):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


# --- prefix-identical ids: a later turn's prompt ids extend the earlier prompt + the reply as generated

BPE_TEMPLATE = (  # tool-aware (it lists the tools); the assistant's turn ends with the end-of-sequence token
    "{% if tools %}{{ 'tools:' }}{% for t in tools %}{{ ' ' + t['function']['name'] }}{% endfor %}{{ '\n' }}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ 'assistant: ' + m['content'] + eos_token + '\n' }}"
    "{% else %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


def _bpe_tokenizer(template=BPE_TEMPLATE):
    """A byte-level BPE tokenizer (GPT-2 / Qwen style pre-tokenization) trained here on chat-like text."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    corpus = []
    for _ in range(200):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        corpus.append(f"user: what is {a}+{b}?\nassistant: the answer needs <tool_call>calculator {a}+{b}"
                      f"</tool_call></s>\ntool: {a + b}\nassistant: the answer is {a + b}</s>\n")
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "</s>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                                         show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>", pad_token="<pad>")
    tok.chat_template = template
    return tok


def test_a_later_turn_extends_the_earlier_ids_with_a_bpe_tokenizer():
    tok = _bpe_tokenizer()
    episode = _encoding_run(tok, [f"the answer needs {CALL}", "the answer is \\boxed{294}"])
    first, second = episode.turns
    earlier = first.prompt_ids + first.response_ids
    assert second.prompt_ids[:len(earlier)] == earlier
    schemas = tool_schemas(as_tools([calculator]))
    rendered = tok.apply_chat_template(episode.info["messages"][:3], tools=schemas, add_generation_prompt=True,
                                       tokenize=False)
    assert second.prompt_text == rendered  # the template's text, spelled by the extended ids
    assert tok.decode(second.prompt_ids, skip_special_tokens=False) == rendered
    # re-tokenizing the rendered text merges "assistant: " with the reply's first word ("Ġthe"): not a prefix
    naive = tok(rendered, add_special_tokens=False)["input_ids"]
    assert naive[:len(earlier)] != earlier and tok.decode(naive) == tok.decode(second.prompt_ids)
    from masrl.training.conversation import merge_extending_rows
    from masrl.training.update import Row

    rows = [Row(t.agent, t.prompt_ids, t.response_ids, [0.0] * len(t.response_ids), 1.0) for t in episode.turns]
    assert len(merge_extending_rows(rows)) == 1


def test_a_reply_spelled_in_other_tokens_is_kept_as_generated():
    """A char model may write an added token's text character by character; the next prompt keeps those ids."""
    tok = build_char_tokenizer(CHAT_TOKENS)
    per_char = lambda reply: [tok.convert_tokens_to_ids(c) for c in reply] + [tok.eos_token_id]  # noqa: E731
    episode = _encoding_run(tok, [CALL, "\\boxed{294}"], encode_reply=per_char)
    first, second = episode.turns
    earlier = first.prompt_ids + first.response_ids
    assert second.prompt_ids[:len(earlier)] == earlier
    assert tok(second.prompt_text, add_special_tokens=False)["input_ids"][:len(earlier)] != earlier
    assert tok.decode(second.prompt_ids, skip_special_tokens=False) == second.prompt_text


def test_a_template_that_rewrites_earlier_replies_gets_the_ids_of_its_text():
    """No prefix to extend (the template drops earlier replies' text): the ids of the whole rendered text."""
    rewriting = BPE_TEMPLATE.replace("'assistant: ' + m['content']", "'assistant: ' + (m['content'] if loop.last else '...')")
    tok = _bpe_tokenizer(rewriting)
    episode = _encoding_run(tok, [f"the answer needs {CALL}", "\\boxed{294}"])
    first, second = episode.turns
    assert "assistant: ...</s>\ntool: 294" in second.prompt_text
    assert second.prompt_ids == tok(second.prompt_text, add_special_tokens=False)["input_ids"]


def test_a_template_without_tool_support_gets_the_tools_in_the_system_message_hermes_style():
    """SmolLM2-Instruct's ChatML template knows no tools: the conversation renders as Qwen2.5's tool-aware
    template renders it (tools in the system message, results as <tool_response> in a user turn)."""
    from masrl.models.smollm import SMOLLM2_CHAT_TEMPLATE
    from masrl.tools.chat_format import hermes_tool_messages

    smol, qwen = build_char_tokenizer(CHAT_TOKENS), build_char_tokenizer(CHAT_TOKENS)
    smol.chat_template, qwen.chat_template = SMOLLM2_CHAT_TEMPLATE, QWEN_STYLE_TEMPLATE
    schemas = tool_schemas(as_tools([calculator]))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TASK.question},
                {"role": "assistant", "content": CALL + CALL}, {"role": "tool", "name": "calculator", "content": "294"},
                {"role": "tool", "name": "calculator", "content": "294"}]
    for shown in (messages[:2], messages):
        assert render_chat(smol, shown, schemas) == qwen.apply_chat_template(
            shown, tools=schemas, add_generation_prompt=True, tokenize=False)
    assert render_chat(smol, messages, schemas).endswith(
        "<|im_start|>user\n<tool_response>\n294\n</tool_response>\n<tool_response>\n294\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    no_system = hermes_tool_messages(messages[1:2], schemas)  # the tool block is the system message
    assert no_system[0]["role"] == "system" and no_system[0]["content"].startswith("# Tools\n\nYou may call")
    assert render_chat(smol, messages[1:2]) == smol.apply_chat_template(messages[1:2], add_generation_prompt=True,
                                                                       tokenize=False)  # no tools: as it was
