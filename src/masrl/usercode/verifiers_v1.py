"""A verifiers v1 ``Env`` is user code: loaded here (its module or function, its ``setup`` probed once), with every
role played by ``masrl-chat``, an in-process harness whose model calls go to verifiers' interception server (which
records them on the role's trace) and from there to masrl's gateway with ``model`` = the masrl agent the role maps
to. ``task: verifiers_v1`` (``masrl.tasks.environments.verifiers_v1``) builds its tasks; ``workflow: environment``
(``masrl.workflows.verifiers_play``) plays its episodes.
"""
from __future__ import annotations

import sys
import types
from typing import Any

from masrl.errors import ConfigError

HARNESS = "masrl-chat"


def _register_harness(vf: Any) -> None:
    """The ``masrl-chat`` harness, importable by its id as verifiers resolves harnesses (module ``masrl_chat``)."""
    if "masrl_chat" in sys.modules:
        return
    from verifiers.v1.dialects.chat import message_to_wire
    from verifiers.v1.runtimes import ProgramResult

    class MasrlChatConfig(vf.HarnessConfig):
        pass

    class MasrlChat(vf.Harness[MasrlChatConfig]):
        """A tool-less chat turn, in-process: one chat completion per segment through the interception endpoint
        (no program, no ``uv``); the response ids it got are kept in ``trace.info["masrl_response_ids"]``."""

        APPENDS_SYSTEM_PROMPT, SUPPORTS_RESUME, EXECUTES_CODE, NEEDS_CONTAINER = True, True, False, False

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data):
            import openai

            system, prompt = self.resolve_prompt(data)
            messages = [{"role": "system", "content": system}] if system else []
            messages += ([{"role": "user", "content": prompt}] if isinstance(prompt, str) else
                         [message_to_wire(m) for m in prompt or []])
            async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0, timeout=None) as client:
                reply = await client.chat.completions.create(model=ctx.model, messages=messages)
            trace.info.setdefault("masrl_response_ids", []).append(reply.id)
            return ProgramResult(exit_code=0, stdout="", stderr="")

    module = types.ModuleType("masrl_chat")
    module.MasrlChat, module.MasrlChatConfig, module.__all__ = MasrlChat, MasrlChatConfig, ["MasrlChat"]
    sys.modules["masrl_chat"] = module


class V1Game:
    """A loaded Env, its roles (``{role: masrl agent}``), the masrl agents it marks frozen and the reward at which
    an episode counts as correct; ``masrl.workflows.verifiers_play.V1Player`` plays it."""

    def __init__(self, env: Any, roles: dict[str, str], frozen: set[str], pass_threshold: float):
        self.env, self.roles, self.frozen, self.pass_threshold = env, roles, frozen, pass_threshold

    def task(self, row: dict) -> Any:
        """The Env's task of a row (``task.meta["row"]``: the task's data)."""
        cls = self.env._task_cls
        return cls(cls.data_type().model_validate(row), self.env.taskset.config.task)


def load_env(vf: Any, spec: str, env_args: dict) -> Any:
    """``module:function`` / ``file.py:function`` called with ``env_args``, else ``verifiers.v1.load_environment``
    of the taskset id ``spec`` with ``env_args`` as the EnvConfig's fields."""
    if ":" in spec:
        from masrl.usercode.imports import import_object

        make = import_object(spec, "task.params.env")  # a file is importable by its module name
        if not callable(make):
            raise ConfigError(f"task.params.env {spec!r} is not callable (a function returning a verifiers.v1 Env)")
        env = make(**env_args)
    else:
        try:
            taskset = {"id": spec, **(env_args.get("taskset") or {})}
            env = vf.load_environment(vf.resolve_env_config({**env_args, "taskset": taskset}))
        except (ModuleNotFoundError, ValueError, TypeError) as e:
            raise ConfigError(f"task.params.env {spec!r}: {str(e)[:400]}") from None
    if not isinstance(env, vf.Env):
        raise ConfigError(f"task.params.env {spec!r} returned {type(env).__name__}, not a verifiers.v1 Env")
    return env


def played_by_masrl(vf: Any, env: Any, roles: dict[str, str]) -> Any:
    """The Env rebuilt with every role played by ``masrl-chat`` as its masrl agent (local, in-process)."""
    harness = vf.harness_config_type(HARNESS)(id=HARNESS)
    update = {role: getattr(env.config, role).model_copy(update={
        "model": agent, "harness": harness, "runtime": vf.SubprocessConfig(), "client": None})
        for role, agent in roles.items()}
    return type(env)(env.config.model_copy(update=update))


def frozen_agents(vf: Any, env: Any, roles: dict[str, str]) -> set[str]:
    """The masrl agents whose roles the Env's ``setup`` marks ``trainable = False`` (one probe, at load)."""
    from masrl.usercode.calls import call_in_thread

    ctx = vf.ModelContext(model="probe", client=vf.EvalClientConfig(base_url="http://127.0.0.1:9",
                                                                    api_key_var="MASRL_GATEWAY_KEY"))
    agents = env._episode_agents(ctx, [], None, None)
    what = f"{type(env).__name__}.setup"
    try:
        call_in_thread(env.setup, (agents,), 60.0, kind="environment", what=what)  # on a loop of its own
    except Exception as e:  # the Env's own code, run once at load
        raise ConfigError(f"task.params.env: {what} raised {type(e).__name__}: {str(e)[:300]}") from None
    return {roles[name] for name, agent in agents._agents.items() if not agent.trainable}


def load_game(vf: Any, spec: str, env_args: dict, rename: dict, pass_threshold: float) -> V1Game:
    """The Env of ``spec`` with its roles (``{role: masrl agent}``, renamed by ``rename``) played by masrl."""
    _register_harness(vf)
    env = load_env(vf, spec, env_args)
    declared = list(env._agent_specs)
    if sorted(set(rename) - set(declared)):
        raise ConfigError(f"task.params.agents names roles {sorted(set(rename) - set(declared))} that "
                          f"{type(env).__name__} does not declare; its roles: {declared}")
    roles = {role: str(rename.get(role, role)) for role in declared}
    env = played_by_masrl(vf, env, roles)
    return V1Game(env, roles, frozen_agents(vf, env, roles), pass_threshold)
