"""Judge and reward-model options (``task.params.reward: {judge: {...}}`` / ``{model: {...}}``), checked at load.

Every mistake is one ``ConfigError`` naming the key under ``task.params.reward``.
"""
from __future__ import annotations

import re
from typing import Any, Literal, Mapping, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from masrl.errors import ConfigError

VERDICTS = ("score", "yes_no", "yes_prob", "pairwise")
# the placeholders a judge template may use, per verdict; the first group must all appear
TEMPLATE_FIELDS = {"score": ({"question", "answer"}, {"reference", "lo", "hi"}),
                   "yes_no": ({"question", "answer"}, {"reference"}),
                   "yes_prob": ({"question", "answer"}, {"reference"}),
                   "pairwise": ({"question", "answer_a", "answer_b"}, set()),
                   "reward_model": ({"question"}, set())}
DEFAULT_TEMPLATES = {
    "score": ("Rate the answer to the question on a scale from {lo} to {hi}.\nQuestion: {question}\n"
              "Reference answer: {reference}\nAnswer: {answer}\nReply with 'Score: N'."),
    "yes_no": ("Is the answer to the question correct?\nQuestion: {question}\nReference answer: {reference}\n"
               "Answer: {answer}\nReply yes or no."),
    "yes_prob": ("Is the answer to the question correct?\nQuestion: {question}\nReference answer: {reference}\n"
                 "Answer: {answer}\nReply yes or no."),
    "pairwise": ("Which answer to the question is better?\nQuestion: {question}\nAnswer A: {answer_a}\n"
                 "Answer B: {answer_b}\nReply [[A]], [[B]] or [[tie]]."),
}
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class RemoteOptions(_Strict):
    """An OpenAI-compatible ``/chat/completions`` endpoint."""

    base_url: str = Field(description="the API root, e.g. http://127.0.0.1:8000/v1")
    model: str = Field(description="the model name the endpoint serves")
    api_key_env: Optional[str] = Field("OPENAI_API_KEY", description=(
        "environment variable holding the key (never written to the run folder); null: no key"))
    timeout_s: float = Field(30.0, gt=0, description="deadline of one call: connect, send and the whole "
                                                       "reply (a reply that trickles in is cut off at it)")
    retries: int = Field(2, ge=0, description="retries of a call that timed out or got a 429/5xx/connection error")
    backoff_s: float = Field(0.5, ge=0, description="first retry delay; doubled at each retry")
    max_calls_per_step: Optional[int] = Field(None, ge=1, description="calls allowed per step; the rest are errors")
    concurrency: int = Field(8, ge=1, description="calls in flight at once")


class JudgeOptions(_Strict):
    """An LLM judge: a frozen local model (``model``) or an endpoint (``remote``), greedy, one verdict per answer."""

    model: Optional[str] = Field(None, description="tiny, a local folder, a hub id or an alias (as a policy's model)")
    tiny: dict[str, Any] = Field(default_factory=dict, description="tiny model config overrides (model: tiny)")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    trust_remote_code: bool = False
    init_seed: int = Field(0, description="seed of a tiny judge's random weights")
    remote: Optional[RemoteOptions] = None
    verdict: Literal["score", "yes_no", "yes_prob", "pairwise"] = "score"
    min_verdict_mass: float = Field(0.01, ge=0, le=1, description=(
        "yes_prob: a reply whose first token puts less probability than this on yes + no has no verdict"))
    pairwise_against: Literal["reference", "group"] = Field("reference", description=(
        "pairwise: compare each answer with the task's reference, or with other answers of its group (the same "
        "task in the batch); both orders either way"))
    opponents: int = Field(1, ge=1, description=(
        "pairwise_against: group: answers of the group each answer is compared with (the next ones, cyclically)"))
    template: Optional[str] = Field(None, description="the judge prompt; fields per verdict (docs/training.md)")
    system_prompt: Optional[str] = None
    scale: tuple[float, float] = Field((1.0, 10.0), description="verdict score: the stated [lo, hi] scale")
    max_new_tokens: int = Field(32, ge=1, le=4096)
    max_error_share: float = Field(1.0, gt=0, le=1, description=(
        "a step whose failed calls (errors and timeouts) reach this share of its calls stops the run (exit 2, one "
        "line); 1.0: only a step where every call failed"))
    max_batch_size: int = Field(64, ge=1, description="answers judged in one generate call")
    correct_threshold: float = Field(0.5, description="a judged reward >= this counts as correct")
    check: Optional[Literal["math", "qa_em", "qa_f1"]] = Field(None, description=(
        "a rule-based reward logged beside the judge (judge/heldout_check); it also sets how gold answers are read"))

    @model_validator(mode="after")
    def _one_backend(self):
        if (self.model is None) == (self.remote is None):
            raise ValueError("set exactly one of model (a local judge) and remote (an endpoint)")
        lo, hi = self.scale
        if not lo < hi:
            raise ValueError(f"scale must be [lo, hi] with lo < hi, got {list(self.scale)}")
        return self


class RewardModelOptions(_Strict):
    """A Hugging Face sequence-classification reward model (one logit per answer)."""

    path: str = Field(description="a local folder or hub id of an AutoModelForSequenceClassification")
    kind: Literal["sequence_classification"] = "sequence_classification"
    normalize: Literal["sigmoid", "none", "minmax"] = Field("sigmoid", description=(
        "sigmoid(logit); none: the raw logit; minmax: (logit - min) / (max - min) over the step's batch"))
    template: Optional[str] = Field(None, description="the user message, fields {question} (default: the question)")
    batch_size: int = Field(16, ge=1)
    max_error_share: float = Field(1.0, gt=0, le=1, description=(
        "a step whose failed calls (errors and timeouts) reach this share of its calls stops the run (exit 2, one "
        "line); 1.0: only a step where every call failed"))
    max_length: int = Field(1024, ge=8, description="question + answer tokens kept (the end of longer ones)")
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    trust_remote_code: bool = False
    correct_threshold: float = 0.5
    check: Optional[Literal["math", "qa_em", "qa_f1"]] = None


def parse_options(cls: type[_Strict], options: Mapping[str, Any], key: str):
    """``cls(**options)`` or one ConfigError naming ``task.params.reward.<key>.<field>``."""
    try:
        return cls(**dict(options))
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = f"unknown option; known: {', '.join(cls.model_fields)}"
        raise ConfigError(f"task.params.reward.{key}{'.' + where if where else ''}: {msg}") from None


def check_template(template: str, verdict: str, key: str) -> str:
    """The template, after checking its ``{fields}`` against those ``verdict`` knows (ConfigError otherwise)."""
    required, optional = TEMPLATE_FIELDS[verdict]
    used = set(_PLACEHOLDER.findall(template))
    unknown = sorted(used - required - optional)
    if unknown:
        raise ConfigError(f"task.params.reward.{key}.template: unknown field(s) {unknown}; a {verdict} template "
                          f"uses {sorted(required | optional)}")
    missing = sorted(required - used)
    if missing:
        raise ConfigError(f"task.params.reward.{key}.template: missing field(s) {missing} (a {verdict} judge "
                          f"needs {sorted(required)})")
    return template
