"""Rendering a conversation (with tools) into a prompt: the tokenizer's own chat template.

A :class:`ChatPrompt` is what ``team.chat`` hands to the rollout backend instead of a prompt
string: the agent's messages (system / user / assistant / tool) and the tool schemas. The
backend renders it with :func:`render_chat`:

- the tokenizer's chat template, ``apply_chat_template(messages, tools=..., add_generation_prompt=True)``,
  when the conversation has no tools and no tool messages, or when the template knows tools
  (its source mentions ``tools``): real instruction models see the format they were trained on;
- otherwise :data:`FALLBACK_CHAT_TEMPLATE`, a terse template for small character-level models
  (the tiny test models) whose template has no tool support: one line
  ``Tools: name(arg,...) ...``, then system content + newline, user content as it is,
  assistant content + end-of-sequence, tool results as ``<tool_response>...</tool_response>``.
  Without tools it renders exactly like the tiny model's own template.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FALLBACK_CHAT_TEMPLATE = (
    "{% if tools %}{{ 'Tools:' }}{% for t in tools %}{{ ' ' + t['function']['name'] + '(' }}"
    "{{ t['function']['parameters']['properties'] | join(',') }}{{ ')' }}{% endfor %}{{ '\n' }}{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}{{ message['content'] + '\n' }}"
    "{% elif message['role'] == 'user' %}{{ message['content'] }}"
    "{% elif message['role'] == 'tool' %}{{ '<tool_response>' + message['content'] + '</tool_response>' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)


@dataclass
class ChatPrompt:
    """An agent's conversation so far and the tools it may call (OpenAI-format schemas)."""

    messages: list[dict[str, Any]]
    tools: list[dict] | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def transcript(self) -> str:
        """A plain ``role: content`` rendering (for logs and scripted runs, not for models)."""
        return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in self.messages)


def template_handles_tools(tokenizer: Any, chat_template: str | None = None) -> bool:
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: the one used for tools
        template = template.get("tool_use") or template.get("default")
    return isinstance(template, str) and "tools" in template


def render_chat(tokenizer: Any, messages: list[dict], tools: list[dict] | None = None,
                **template_kwargs: Any) -> str:
    """The prompt text for ``messages`` (+ ``tools``), ending where the assistant's reply starts."""
    uses_tools = bool(tools) or any(m.get("role") == "tool" for m in messages)
    if uses_tools and not template_handles_tools(tokenizer, template_kwargs.get("chat_template")):
        template_kwargs = {**template_kwargs, "chat_template": FALLBACK_CHAT_TEMPLATE}
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=True, **template_kwargs)
