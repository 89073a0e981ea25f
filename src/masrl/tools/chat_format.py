"""Rendering a conversation (with tools) into a prompt: the tokenizer's own chat template.

A ``ChatPrompt`` is what ``team.chat`` hands to the rollout backend instead of a prompt
string: the agent's messages (system / user / assistant / tool) and the tool schemas. The
backend renders it with ``render_chat``:

- the tokenizer's chat template, ``apply_chat_template(messages, tools=..., add_generation_prompt=True)``,
  when the conversation has no tools and no tool messages, or when the template knows tools
  (its source mentions ``tools``): real instruction models see the format they were trained on;
- a template without tool support (SmolLM2-Instruct's ChatML, Llama-2 style ones) still renders
  the conversation, with the tools described the Hermes way (``hermes_tool_messages``): the
  system message gets the block Qwen2.5's template writes (``# Tools`` ... ``<tools>`` one JSON
  schema per line ``</tools>`` ... how to write ``<tool_call>``), and each run of tool results
  becomes one user message of ``<tool_response>\n...\n</tool_response>`` blocks. On a ChatML
  template this is exactly Qwen2.5's rendering;
- the masrl tiny character models' template (``masrl.models.tiny.TINY_CHAT_TEMPLATE``) uses
  ``FALLBACK_CHAT_TEMPLATE`` instead, a terse one: one line ``Tools: name(arg,...) ...``,
  then system content + newline, user content as it is, assistant content + end-of-sequence,
  tool results as ``<tool_response>...</tool_response>``. Without tools it renders exactly like
  the tiny model's own template.

Token ids of a conversation's next turn (``extend_chat_ids``): the previous turn's prompt
ids + the ids the model generated + the ids of the rendering's *delta* (what the template adds
after the reply: end-of-turn markers, tool messages, the next generation prompt), as the
verl / TRL agent loops do. Re-tokenizing the whole rendered text instead can differ from the
ids the model saw and produced: a BPE tokenizer merges across the reply's boundary, and a
model may spell a word in other tokens than the tokenizer would (``<`` ``t`` ``o`` ... for an
added ``<tool_call>`` token). With the incremental ids the earlier prompt + reply is a token
prefix of the next prompt, so the rollout engine's prefix store reuses its keys/values and
``trainer.merge_conversations`` trains the turns as one sequence. When the template does not
render the earlier turns as a prefix of the later ones (one that drops an earlier reply's
reasoning, say) the ids are those of the whole rendered text.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from masrl.models.tiny import TINY_CHAT_TEMPLATE

FALLBACK_CHAT_TEMPLATE = (
    "{% if tools %}{{ 'Tools:' }}{% for t in tools %}{{ ' ' + t['function']['name'] + '(' }}"
    "{{ t['function']['parameters']['properties'] | join(',') }}{{ ')' }}{% endfor %}{{ '\n' }}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] + '\n' }}"
    "{% elif message['role'] == 'user' %}{{ message['content'] }}"
    "{% elif message['role'] == 'tool' %}{{ '<tool_response>' + message['content'] + '</tool_response>' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)


# Qwen2.5's tool block (its chat template's text), for templates without tool support
HERMES_TOOLS_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}}\n</tool_call>"
)


@dataclass
class ChatPrefix:
    """The previous model call of the same conversation: ``messages[:n_messages]`` was its prompt,
    encoded as ``prompt_ids``; it generated ``response_ids`` (its reply is ``messages[n_messages]``)."""

    n_messages: int
    prompt_ids: list[int]
    response_ids: list[int]

    @classmethod
    def of(cls, turn: Any, n_messages: int) -> "ChatPrefix | None":
        """What the next call extends: ``turn``'s full prompt ids and its reply, or None for a turn that
        cannot be extended (refused, or its prompt cut to fit the context)."""
        if not turn.prompt_ids or "prompt_truncated_from" in turn.info or "refused" in turn.info:
            return None
        return cls(n_messages, list(turn.prompt_ids), list(turn.response_ids))


@dataclass
class ChatPrompt:
    """An agent's conversation so far and the tools it may call (OpenAI-format schemas);
    ``prefix``: the previous call of this conversation, to extend its token ids (``extend_chat_ids``)."""

    messages: list[dict[str, Any]]
    tools: list[dict] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    prefix: ChatPrefix | None = None

    def transcript(self) -> str:
        """A plain ``role: content`` rendering (for logs and scripted runs, not for models)."""
        return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in self.messages)


def _template(tokenizer: Any, chat_template: str | None = None) -> Any:
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the one used for tools
        template = template.get("tool_use") or template.get("default")
    return template


def template_handles_tools(tokenizer: Any, chat_template: str | None = None) -> bool:
    template = _template(tokenizer, chat_template)
    return isinstance(template, str) and "tools" in template


def hermes_tool_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """``messages`` for a template without tool support: the tools described in the system message
    (``HERMES_TOOLS_SYSTEM`` after the system content, as Qwen2.5 writes it; a system message of
    its own if there is none), each run of tool messages as one user message of ``<tool_response>``
    blocks."""
    out: list[dict] = []
    rest = list(messages)
    if tools:
        block = HERMES_TOOLS_SYSTEM.format(tools="".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools))
        system = rest.pop(0)["content"] + "\n\n" if rest and rest[0].get("role") == "system" else ""
        out.append({"role": "system", "content": system + block})
    previous_tool = False
    for m in rest:
        if m.get("role") != "tool":
            out.append(m)
            previous_tool = False
            continue
        response = f"<tool_response>\n{m.get('content', '')}\n</tool_response>"
        if previous_tool:
            out[-1] = {"role": "user", "content": out[-1]["content"] + "\n" + response}
        else:
            out.append({"role": "user", "content": response})
        previous_tool = True
    return out


def render_chat(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
    """The prompt text for ``messages`` (+ ``tools``), ending where the assistant's reply starts
    (``add_generation_prompt=False``: where the last message ends). See the module docstring."""
    uses_tools = bool(tools) or any(m.get("role") == "tool" for m in messages)
    if uses_tools and not template_handles_tools(tokenizer, template_kwargs.get("chat_template")):
        if _template(tokenizer, template_kwargs.get("chat_template")) == TINY_CHAT_TEMPLATE:
            template_kwargs = {**template_kwargs, "chat_template": FALLBACK_CHAT_TEMPLATE}
        else:
            messages, tools = hermes_tool_messages(messages, tools), None
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **template_kwargs)


def extend_chat_ids(tokenizer: Any, messages: list[dict], tools: list[dict] | None, prefix: ChatPrefix,
                    **template_kwargs: Any) -> list[int] | None:
    """The prompt ids of ``messages`` as ``prefix.prompt_ids + prefix.response_ids + delta ids``, or
    None when the template's rendering of the conversation does not extend the previous prompt.

    ``delta``: the text the template adds after the reply as the model generated it (the end-of-turn
    marker when the reply was cut before it, the template's separator, the messages after the reply,
    the generation prompt). The reply must render as the decoded ``response_ids`` (skipping no special
    token), else None.
    """
    n = prefix.n_messages
    if not 0 < n < len(messages) or messages[n].get("role") != "assistant":
        return None
    before = render_chat(tokenizer, messages[:n], tools, **template_kwargs)
    with_reply = render_chat(tokenizer, messages[:n + 1], tools, add_generation_prompt=False, **template_kwargs)
    full = render_chat(tokenizer, messages, tools, **template_kwargs)
    if not (with_reply.startswith(before) and full.startswith(with_reply)):
        return None
    reply = with_reply[len(before):]
    generated = tokenizer.decode(prefix.response_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    if not reply.startswith(generated):
        return None
    delta = reply[len(generated):] + full[len(with_reply):]
    return extend_ids(tokenizer, prefix.prompt_ids, prefix.response_ids, delta)


def extend_ids(tokenizer: Any, prompt_ids: list[int], response_ids: list[int], delta: str) -> list[int]:
    """``prompt_ids + response_ids + ids(delta)``, the delta encoded on its own without inserting special
    tokens (no BOS): an earlier prompt and the reply as generated stay a token prefix of the next prompt."""
    return list(prompt_ids) + list(response_ids) + tokenizer(delta, add_special_tokens=False)["input_ids"]


_SAME_VOCAB: dict[tuple[int, int], tuple[Any, Any, bool]] = {}  # holds the pair: their ids stay theirs


def same_vocabulary(a: Any, b: Any) -> bool:
    """Whether tokenizers ``a`` and ``b`` map every token to the same id (ids of one mean the same in the other)."""
    if a is b:
        return True
    key = (id(a), id(b))
    if key not in _SAME_VOCAB:
        _SAME_VOCAB[key] = (a, b, a.get_vocab() == b.get_vocab())
    return _SAME_VOCAB[key][2]
