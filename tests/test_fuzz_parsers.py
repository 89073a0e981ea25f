"""Fuzzing the parsers of model output (hypothesis).

Guarantees (docs/reliability.md): on any text (unicode, huge, unbalanced braces/tags) they never
raise and give None / "invalid" when there is no well-formed answer; well-formed answers
round-trip; the tag/box parsers are linear-time.
"""
import re
import time

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from masrl.tasks.math_reward import extract_prediction, math_score, normalize_number
from masrl.tasks.qa import exact_match, f1_score, normalize_answer as qa_normalize
from masrl.types import Task
from masrl.workflows.base import render
from masrl.workflows.parsing import extract_boxed, extract_tag, parse_choice
from masrl.workflows.search import fill
from masrl.workflows.common import majority_vote, normalize_answer, parse_index, parse_subtasks, parse_verdict

FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# pieces that make text look almost like model output: unbalanced braces, half tags, markers
FRAGMENTS = ["\\boxed", "\\boxed{", "\\boxed {", "{", "}", "{}", "\\", "\\text{", "\\textbf{", "$", " ", "\n", "\r\n",
             "<verify>", "</verify>", "<verify", "verify>", "<search>", "</search>", "<answer>", "</answer>",
             "</think>", "<think>", "approve", "reject", "yes", "no", "correct", "Incorrect", "SUBTASK 1:",
             "subtask 2.", "**SUBTASK 3**:", "#", "2", "42", "1,000", "é", "\u2028", "\x00", "🙂", "Σ"]
garbage = st.one_of(
    st.text(),
    st.text(alphabet=st.sampled_from("{}\\<>/boxedvrifyan \n")),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=4)), max_size=40).map("".join),
)
# large inputs, built by repetition (cheap to generate)
huge = st.builds(lambda piece, n: (piece or "x") * n, st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=6)
                 .map("".join), st.integers(1_000, 8_000))
not_text = st.one_of(st.none(), st.integers(), st.floats(), st.binary(max_size=8), st.lists(st.text(max_size=3)))

# brace-balanced text (for round trips), free of "\boxed"
_no_braces = st.text(alphabet=st.characters(blacklist_characters="{}\\"), max_size=8)
balanced = st.recursive(_no_braces, lambda inner: st.one_of(inner.map(lambda s: "{" + s + "}"),
                                                           st.lists(inner, max_size=3).map("".join)), max_leaves=10)
word_tag = st.sampled_from(["verify", "search", "answer", "think"]) | st.from_regex(r"[a-z]{1,8}", fullmatch=True)


# ----------------------------------------------------------------------------- reference implementations

def reference_boxed(text):
    """The spec, written the slow obvious way: last \\boxed whose "{" closes, depth-counted."""
    for m in reversed(list(re.finditer(r"\\boxed", text))):
        i = m.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    return text[i + 1:j].strip()
    return None


def reference_tag(text, tag):
    found = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return found[-1].strip() if found else None


# ----------------------------------------------------------------------------- extract_boxed

@FUZZ
@given(garbage)
def test_extract_boxed_never_raises_and_matches_reference(text):
    got = extract_boxed(text)
    assert got == reference_boxed(text)
    if got is not None:
        assert got in text and got == got.strip()
    if "\\boxed" not in text:
        assert got is None


@FUZZ
@given(not_text)
def test_parsers_reject_non_text(obj):
    assert extract_boxed(obj) is None
    assert extract_tag(obj, "verify") is None
    assert parse_choice(obj, "verify", ("yes", "no")) is None
    assert extract_prediction(obj) is None
    assert parse_verdict(obj) is None
    assert parse_index(obj, 3) is None
    assert parse_subtasks(obj) == []


@FUZZ
@given(garbage, balanced, garbage, st.sampled_from(["", " ", "   "]))
def test_extract_boxed_round_trip(prefix, content, suffix, spaces):
    assume("\\boxed" not in suffix)
    text = f"{prefix}\\boxed{spaces}{{{content}}}{suffix}"
    assert extract_boxed(text) == content.strip()


# ----------------------------------------------------------------------------- extract_tag / parse_choice

@FUZZ
@given(garbage, st.one_of(word_tag, st.text(max_size=6)))
def test_extract_tag_never_raises_and_matches_regex_reference(text, tag):
    got = extract_tag(text, tag)
    if not tag:
        assert got is None
        return
    assert got == reference_tag(text, tag)
    if f"</{tag}>" not in text:
        assert got is None
    if got is not None:
        assert got in text


@FUZZ
@given(garbage, word_tag, garbage, garbage)
def test_extract_tag_round_trip(prefix, tag, content, suffix):
    open_, close = f"<{tag}>", f"</{tag}>"
    assume(open_ not in prefix and close not in content and close not in suffix)
    assert extract_tag(f"{prefix}{open_}{content}{close}{suffix}", tag) == content.strip()


@FUZZ
@given(garbage, st.sampled_from([("yes", "no"), ("approve", "reject")]))
def test_parse_choice_is_none_or_a_choice(text, choices):
    assert parse_choice(text, "verify", choices) in (None, *choices)


@FUZZ
@given(garbage, st.sampled_from(["yes", "no", "approve", "reject"]), st.sampled_from(["", " ", "\n ", "\t"]),
       st.sampled_from([str.lower, str.upper, str.title]))
def test_parse_choice_round_trip(prefix, choice, pad, case):
    assume("<verify>" not in prefix)
    text = f"{prefix}<verify>{pad}{case(choice)}{pad}</verify> trailing"
    choices = ("yes", "no") if choice in ("yes", "no") else ("approve", "reject")
    assert parse_choice(text, "verify", choices) == choice
    assert parse_choice(text, "verify", ("maybe",)) is None


# ----------------------------------------------------------------------------- study parsers

@FUZZ
@given(garbage, st.integers(-3, 50), st.integers(-2, 6))
def test_study_parsers_never_raise(text, n, max_subtasks):
    assert parse_verdict(text) in (None, "correct", "incorrect")
    index = parse_index(text, n)
    assert index is None or 1 <= index <= n
    subtasks = parse_subtasks(text, max_subtasks)
    assert isinstance(subtasks, list) and len(subtasks) <= max(max_subtasks, 0)
    for s in subtasks:
        assert s and s == s.strip() and len(s.splitlines()) == 1 and s in text
    if "\\boxed" not in text:
        assert parse_verdict(text) is None and parse_index(text, n) is None
    norm = normalize_answer(text)
    assert norm is None or (isinstance(norm, str) and norm)


@FUZZ
@given(garbage, st.sampled_from(["correct", "incorrect"]),
       st.sampled_from(["{}", "{} ", " {}.", "\\text{{{}}}", "\\textbf{{ {} }}!", "**{}**"]),
       st.sampled_from([str.lower, str.upper, str.title]))
def test_parse_verdict_round_trip(prefix, word, fmt, case):
    assert parse_verdict(f"{prefix}\\boxed{{{fmt.format(case(word))}}}") == word


@FUZZ
@given(garbage, st.integers(0, 60), st.integers(1, 50),
       st.sampled_from(["{}", "\\text{{{}}}", "Solution {}", "#{}", "response {}.", " {} "]))
def test_parse_index_round_trip(prefix, i, n, fmt):
    expected = i if 1 <= i <= n else None
    assert parse_index(f"{prefix} so the best is \\boxed{{{fmt.format(i)}}}", n) == expected


desc = st.from_regex(r"[A-Za-z][A-Za-z0-9 ,.]{0,30}", fullmatch=True)


@FUZZ
@given(st.lists(desc, min_size=1, max_size=5), st.lists(garbage, max_size=4), st.randoms(use_true_random=False),
       st.sampled_from(["SUBTASK {k}: {d}", "- **SUBTASK {k}:** {d}", "subtask {k}. {d}", "### Subtask {k}) {d}"]))
def test_parse_subtasks_round_trip(descs, noise, rnd, fmt):
    assume(all(re.search("subtask", n, re.IGNORECASE) is None for n in noise))
    lines = [fmt.format(k=k, d=d) for k, d in enumerate(descs, start=1)] + noise
    rnd.shuffle(lines)
    assert parse_subtasks("\n".join(lines), max_subtasks=len(descs)) == [d.strip() for d in descs]
    assert parse_subtasks("\n".join(lines), max_subtasks=len(descs) - 1) == [d.strip() for d in descs[:-1]]


@FUZZ
@given(st.lists(st.one_of(st.none(), garbage, st.sampled_from(["42", " 42 ", "\\text{42}", "$42$", "7"])),
                max_size=8))
def test_majority_vote_picks_first_of_most_common(answers):
    got = majority_vote(answers)
    normal = [normalize_answer(a) for a in answers]
    valid = [a for a in normal if a is not None]
    if not valid:
        assert got is None
        return
    assert got is not None and normal[got] is not None
    top = max(valid.count(a) for a in valid)
    assert valid.count(normal[got]) == top
    assert all(normal[i] is None or valid.count(normal[i]) < top for i in range(got))


# ----------------------------------------------------------------------------- templates (search / base)

@FUZZ
@given(garbage, garbage)
def test_template_filling_is_one_pass(value, template):
    assert fill("{query}", query=value) == value  # inserted text is never re-scanned
    assert render("{question}", question=value) == value
    fill(template, query=value, step=1)  # any template: never raises
    render(template, question=value)


# ----------------------------------------------------------------------------- math reward

GOLD = Task(id="t", question="?", answer="42")


@FUZZ
@given(garbage)
def test_extract_prediction_reads_after_last_think(text):
    expected = extract_boxed(text.rsplit("</think>", 1)[-1])
    assert extract_prediction(text) == expected
    normalize_number(text)  # never raises


@FEW
@given(garbage)
def test_math_score_never_raises_on_garbage(text):
    result = math_score(GOLD, text)
    assert result["reward"] in (0.0, 1.0) and result["correct"] == (result["reward"] == 1.0)
    if extract_prediction(text) is None:
        assert result["reason"] in ("no_answer", "no_boxed") and result["reward"] == 0.0


@FUZZ
@given(st.one_of(not_text, garbage.filter(lambda t: "\\boxed" not in t)))
def test_math_score_without_box_is_invalid(answer):
    result = math_score(GOLD, answer)
    assert result == {"reward": 0.0, "correct": False, "pred": None,
                      "reason": result["reason"]} and result["reason"] in ("no_answer", "no_boxed")


@FUZZ
@given(garbage, st.integers(-10**9, 10**9), st.integers(-10**9, 10**9), st.booleans())
def test_math_score_number_round_trip(prefix, gold, other, commas):
    assume(gold != other)
    task = Task(id="t", question="?", answer=str(gold))
    shown = f"{gold:,}" if commas else str(gold)
    assert math_score(task, f"{prefix}</think> so \\boxed{{{shown}}}")["correct"] is True
    assert math_score(task, f"{prefix}</think> so \\boxed{{{other}}}")["correct"] is False


# ----------------------------------------------------------------------------- QA normalisation

@FUZZ
@given(st.one_of(garbage, not_text))
def test_qa_normalize_answer_is_a_clean_fixed_point(text):
    norm = qa_normalize(text)
    assert isinstance(norm, str)
    assert qa_normalize(norm) == norm
    assert norm == " ".join(norm.split())
    assert not set(norm) & set("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
    assert re.search(r"\b(a|an|the)\b", norm) is None


@FUZZ
@given(garbage, st.lists(st.one_of(st.none(), garbage), max_size=4))
def test_qa_scores_are_bounded(prediction, golds):
    for fn in (exact_match, f1_score):
        assert 0.0 <= fn(prediction, golds) <= 1.0
    if qa_normalize(prediction):
        assert exact_match(prediction, [prediction]) == 1.0 and f1_score(prediction, [prediction]) == 1.0


# ----------------------------------------------------------------------------- huge and degenerate outputs

@FEW
@given(huge, st.integers(1, 5))
def test_huge_inputs_never_raise(text, n):
    if len(text) < 4_000:  # the reference is quadratic: compare on the smaller ones only
        assert extract_boxed(text) == reference_boxed(text)
    else:
        extract_boxed(text)
    extract_tag(text, "verify")
    parse_choice(text, "verify", ("yes", "no"))
    parse_verdict(text)
    parse_index(text, n)
    parse_subtasks(text, n)
    extract_prediction(text)
    qa_normalize(text)


@pytest.mark.parametrize("text,tag", [
    ("\\boxed{" * 30_000, "verify"),                        # unclosed boxes, one after another
    ("<verify>" * 25_000, "verify"),                        # unclosed tags
    ("{" * 150_000 + "\\boxed{1}", "verify"),
    ("\\boxed{" + "{" * 90_000 + "}" * 90_000 + "}", "v"),  # deep nesting
    ("<v>" + "<v>" * 60_000 + "x</v>", "v"),
], ids=["unclosed-boxes", "unclosed-tags", "open-braces", "deep-nesting", "nested-tags"])
def test_degenerate_outputs_are_parsed_in_linear_time(text, tag):
    start = time.perf_counter()
    boxed, tagged = extract_boxed(text), extract_tag(text, tag)
    extract_prediction(text)
    parse_choice(text, tag, ("x",))
    elapsed = time.perf_counter() - start
    assert elapsed < 5.0, f"{elapsed:.1f}s: quadratic scan?"  # linear: ~0.1 s; the old scans took minutes
    if text.startswith("\\boxed{{"):
        assert boxed == "{" * 90_000 + "}" * 90_000
    if text.endswith("\\boxed{1}"):
        assert boxed == "1"
    if text.endswith("x</v>"):
        assert tagged == "<v>" * 60_000 + "x"
    if text.startswith(("\\boxed{\\boxed", "<verify><verify>")):
        assert boxed is None and tagged is None


def test_long_outputs_are_read_from_their_tail():
    text = "\\boxed{early}" + "x" * 250_000 + "\\boxed{late}"
    assert extract_boxed(text) == "late"
    assert extract_boxed("\\boxed{early}" + "x" * 250_000) is None  # beyond the 200k-character window


# ----------------------------------------------------------------------------- tool calls (masrl.tools)

from masrl.tools import as_tools, calculator, parse_tool_calls, render_tool_call  # noqa: E402
from masrl.tools.parsing import FORMATS, MAX_ATTEMPTS  # noqa: E402

CALL_FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_call", "tool_call>", "{", "}", "[", "]", '"name"', ":", ",",
                  '"arguments"', '"parameters"', '"calculator"', '{"expression": "1+2"}', '"', "\\", "<|python_tag|>",
                  "```json", "```", ";", " ", "\n", "null", "1e999", "\x00", "🙂"]
call_garbage = st.one_of(garbage, st.lists(st.one_of(st.sampled_from(CALL_FRAGMENTS), st.text(max_size=4)),
                                           max_size=40).map("".join))
call_args = st.dictionaries(st.text(max_size=6), st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=6),
                                                           st.lists(st.integers(), max_size=3)), max_size=3)
TOOLS = as_tools([calculator])


def reference_hermes_attempts(text):
    """The number of Hermes call attempts, the obvious way: closed blocks, plus an unclosed one after them."""
    closed = list(re.finditer(r"<tool_call>(.*?)</tool_call>", text, flags=re.DOTALL))
    tail = text[closed[-1].end():] if closed else text
    return len(closed) + ("<tool_call>" in tail)


@FUZZ
@given(call_garbage, st.sampled_from([(f,) for f in FORMATS] + [FORMATS]), st.booleans())
def test_tool_call_parsing_never_raises_and_counts_hermes_attempts(text, formats, with_tools):
    parsed = parse_tool_calls(text, TOOLS if with_tools else None, formats)
    assert len(parsed.calls) + len(parsed.errors) <= MAX_ATTEMPTS + 1
    assert all(c.name in TOOLS for c in parsed.calls) or not with_tools
    if parsed.format == "hermes" or formats == ("hermes",):
        expected = reference_hermes_attempts(text)
        got = len(parsed.calls) + len(parsed.errors)
        assert got == expected or (expected > MAX_ATTEMPTS and got == MAX_ATTEMPTS + 1), (got, expected)


@FUZZ
@given(st.text(min_size=1, max_size=10), call_args, st.sampled_from(["hermes", "json", "llama"]),
       st.sampled_from(["plain", "fence", "python_tag", "string_arguments"]))
def test_every_call_format_round_trips(name, args, fmt, wrap):
    text = render_tool_call(name, args, fmt)
    if fmt != "hermes" and wrap == "fence":
        text = "```json\n" + text + "\n```"
    elif fmt != "hermes" and wrap == "python_tag":
        text = "<|python_tag|>" + text
    elif wrap == "string_arguments":  # templates that write the arguments as a JSON string
        import json

        body = json.dumps({"name": name, "arguments": json.dumps(args)})
        text = f"<tool_call>{body}</tool_call>" if fmt == "hermes" else body
    parsed = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [(name, args)] and not parsed.errors
    assert parsed.format == ("hermes" if fmt == "hermes" else "json")


@pytest.mark.parametrize("text", [
    "<tool_call>{" * 100_000,                                      # unclosed calls, one after another
    "<tool_call>" + "[" * 100_000 + "</tool_call>",                # deep JSON nesting in one call
    "<tool_call>" + '{"a":' * 100_000 + "</tool_call>" * 2,
    '{"name": "calculator", "arguments": ' + "[" * 200_000,        # a bare JSON call that never closes
    ('{"name": "calculator", "arguments": {"expression": "1"}} ' * 20_000),
    "</tool_call>" * 100_000 + "<tool_call>",
], ids=["unclosed-calls", "deep-array", "deep-object", "bare-unclosed", "many-bare", "closers"])
def test_degenerate_tool_call_outputs_are_parsed_in_linear_time(text):
    start = time.perf_counter()
    for formats in [(f,) for f in FORMATS] + [FORMATS]:
        parsed = parse_tool_calls(text, TOOLS, formats)
        assert len(parsed.calls) + len(parsed.errors) <= MAX_ATTEMPTS + 1
    elapsed = time.perf_counter() - start
    assert elapsed < 3.0, f"{elapsed:.1f}s for {len(FORMATS) + 1} parses: quadratic scan?"
