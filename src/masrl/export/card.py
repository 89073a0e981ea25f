"""The model card (README.md) of an export: the run's workflow, agents, estimator, steps, held-out results."""
from __future__ import annotations

from masrl.config import RunConfig

from masrl.evaluation.metrics import stage_name


def model_card(cfg: RunConfig, report: dict, manifest: dict, library: str = "transformers") -> str:
    """Markdown with a YAML header (Hub metadata: ``library`` is ``transformers`` or ``peft``); ``report``
    is the run's report.json (may be empty)."""
    lines = ["---", f"library_name: {library}", "tags: [masrl, reinforcement-learning, multi-agent]", "---", "",
             f"# {cfg.name}: policies trained with masrl", "",
             f"Workflow `{cfg.workflow.name}`, advantage estimator `{cfg.algorithm.estimator}`, seed {cfg.seed}; "
             f"exported from checkpoint step {manifest['step']} of {report.get('steps', '?')} RL steps "
             f"(SFT cold start: {cfg.sft.steps} steps).", "", "## Agents", "",
             "| agent | policy | base model | exported as |", "|---|---|---|---|"]
    for agent, acfg in cfg.agents.items():
        pcfg = cfg.policies[acfg.policy]
        info = manifest["policies"].get(acfg.policy)
        lines.append(f"| {agent} | {acfg.policy} | `{pcfg.model}` | {_where(agent, acfg.policy, info)} |")
    lines += ["", *_results(report, cfg.sft.steps), "", "## Loading", "", "```python",
              "from transformers import AutoModelForCausalLM, AutoTokenizer",
              "model = AutoModelForCausalLM.from_pretrained(FOLDER)   # a full or merged policy folder",
              "tokenizer = AutoTokenizer.from_pretrained(FOLDER)",
              "# a LoRA adapter: PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(POLICY/base), "
              "POLICY/adapters/ROLE)", "```", "",
              "Prompts are rendered with the tokenizer's chat template; each agent's system prompt and "
              "workflow prompts are in `config.yaml` next to this card, which `masrl eval config.yaml` runs as is.",
              ""]
    return "\n".join(lines)


def _where(agent: str, policy: str, info: dict | None) -> str:
    if info is None:
        return "not exported (untrained, or left out by --policy)"
    folders = info["folders"]
    if info["kind"] == "full":
        return f"`{folders['model']}/`"
    key = agent if agent in folders else policy
    if info["kind"] == "merged":
        return f"`{folders[key]}/` (LoRA merged)"
    return f"`{folders['base']}/` + adapter `{folders[key]}/`"


def _results(report: dict, sft_steps: int) -> list[str]:
    history = report.get("eval") or {}
    rows = [(stage_name(label, sft_steps), s) for label, s in history.items() if isinstance(s, dict)]
    if not rows:
        return ["## Held-out results", "", "No held-out evaluation in this run's report.json."]
    keys = [k for k in rows[0][1] if k.startswith(("avg@", "pass@", "maj@"))]
    out = ["## Held-out results (report.json)", "", "| stage | " + " | ".join(keys) + " |",
           "|---|" + "---|" * len(keys)]
    for stage, summary in rows:
        out.append(f"| {stage} | " + " | ".join(_pct(summary.get(k)) for k in keys) + " |")
    return out


def _pct(value) -> str:
    return f"{100 * value:.1f}%" if isinstance(value, (int, float)) else "-"
