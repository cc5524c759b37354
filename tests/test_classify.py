"""The request classifier: hand-written prompts of both kinds, the rules, odd inputs, loading."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from gateway.classify.classifier import Classifier, Rules, Verdict


@pytest.fixture(scope="module")
def clf() -> Classifier:
    return Classifier.load()


def chat(*turns: str, system: str | None = None, **extra: Any) -> dict[str, Any]:
    """A chat body; turns alternate user/assistant and end with the user."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    roles = ["user", "assistant"] * len(turns)
    msgs += [{"role": r, "content": t} for r, t in zip(roles, turns)]
    return {"model": "auto", "messages": msgs, **extra}


# Written for these tests, not taken from the development set.
SIMPLE = [
    "hey there, how's it going?",
    "What's your name?",
    "Thanks a lot, bye!",
    "Who painted the ceiling of the Sistine Chapel?",
    "what is the capital of australia",
    "Give me a one-line slogan for a bicycle repair shop.",
    "What is 3 + 4?",
    "Rewrite this sentence in the passive voice: The dog chased the ball.",
]
# Simple by the rubric, but with no small-talk or lookup shape: the model scores them simple,
# yet the recall-first default threshold (complex recall 0.97 on unseen sources) may send them
# to the big model. At a lower recall target they go to the small one.
SIMPLE_TASKS = [
    "Translate 'good night' into Spanish.",
    "Is this review positive or negative? 'The soup was cold and the waiter ignored us.'",
    "Name three rivers in Africa.",
]
COMPLEX = [
    "Write a Python function that merges two sorted linked lists and explain its time complexity.",
    "Why does my code crash?\n\n```python\nitems = [1, 2, 3]\nprint(items[3])\n```\n"
    "Traceback (most recent call last):\nIndexError: list index out of range",
    "A farmer sells 240 eggs on Monday and twice as many on Tuesday. Each dozen costs $3. "
    "How much money does he earn over the two days?",
    "Prove that the square root of 2 is irrational.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Plan a 5-day itinerary for Kyoto on a budget of $1,500, including food and transport.",
    "Compare and contrast TCP and UDP, with examples of when to use each.",
    "Explain how vaccines train the immune system, in detail.",
    "Solve for x: \\frac{2x + 3}{5} = 7",
    "Design the architecture of a URL shortener that handles 10,000 requests per second.",
]


# The kinds of complex request issue 15 lists as missed on unseen sources, one feature each;
# written for these tests.
MISSED_KINDS = [
    ("open_gen", "Write the plot of a heist movie set on a space station."),
    ("gen_object", "Can you draft a scope of work for renovating a small bakery?"),
    ("counterfactual", "What if the printing press had never been invented?"),
    ("word_math", "What is the product of fourteen, nine and twenty-three?"),
    ("conversion", "What is 350 degrees Fahrenheit in Celsius?"),
    ("code_api", "How do I pass props from a parent to a child component in React?"),
    ("puzzle", "Which is the odd one out: copper, iron, bronze, silver?"),
    ("plan_question", "What are your plans for the first 30 days as our new sales manager?"),
    ("estimate", "How many piano tuners would you need in a city of three million people?"),
]


@pytest.mark.parametrize("feature, prompt", MISSED_KINDS)
def test_missed_kinds_have_a_rubric_feature_and_are_complex(clf: Classifier, feature: str,
                                                            prompt: str) -> None:
    v = clf.classify(chat(prompt))
    assert v.features[feature], (feature, v.features)
    assert v.cls == "complex", (v.score, v.reasons)


# Simple shapes that hard-task cue words used to mistake for hard ones (issue 15 follow-up),
# one feature each; written for these tests.
SIMPLE_SHAPES = [
    ("choices", "Which band recorded the album Rumours?\nA Eagles\nB Fleetwood Mac\n"
                "C The Doors\nD Heart"),
    ("translate_short", 'How would you say "Where is the train station?" in German?'),
]


@pytest.mark.parametrize("feature, prompt", SIMPLE_SHAPES)
def test_simple_shapes_have_a_feature_and_score_simple(clf: Classifier, feature: str,
                                                       prompt: str) -> None:
    v = clf.classify(chat(prompt), threshold=clf.threshold_for_recall(0.85))
    assert v.features[feature], (feature, v.features)
    assert v.score < 0.5 and v.cls == "simple", (prompt, v.score, v.reasons)


def test_numeric_options_are_not_a_lookup(clf: Classifier) -> None:
    # options that are numbers are the answers of a computation (an AQuA-style problem)
    v = clf.classify(chat("A tank fills in 6 hours and drains in 9. How long to fill it?\n"
                          "A)12\nB)18\nC)15\nD)20"))
    assert not v.features["choices"]


def test_a_short_open_question_is_not_small_talk(clf: Classifier) -> None:
    # rubric: an open question of value needs an argued answer; a short message with no cue
    # is small talk only when it asks none
    v = clf.classify(chat("Is ambition a virtue or a vice, morally?"))
    assert v.features["discuss"] and not v.features["smalltalk"] and not v.features["no_hard"]
    assert clf.classify(chat("You are so boring")).features["smalltalk"]


@pytest.mark.parametrize("prompt", SIMPLE)
def test_simple_prompts_are_simple(clf: Classifier, prompt: str) -> None:
    v = clf.classify(chat(prompt))
    assert v.cls == "simple", (prompt, v.score, v.reasons)


@pytest.mark.parametrize("prompt", SIMPLE_TASKS)
def test_simple_tasks_are_simple_below_the_recall_first_target(clf: Classifier,
                                                               prompt: str) -> None:
    v = clf.classify(chat(prompt), threshold=clf.threshold_for_recall(0.85))
    assert v.score < 0.5 and v.cls == "simple", (prompt, v.score, v.reasons)


@pytest.mark.parametrize("prompt", COMPLEX)
def test_complex_prompts_are_complex(clf: Classifier, prompt: str) -> None:
    v = clf.classify(chat(prompt))
    assert v.cls == "complex", (prompt, v.score, v.reasons)


def test_small_talk_then_math_problem_is_complex(clf: Classifier) -> None:
    body = chat("Hi! How are you today?", "I'm great, thanks for asking!",
                "A train travels 180 km in 2.5 hours, then 120 km in 1.5 hours. "
                "What is its average speed for the whole trip in km per hour?")
    assert clf.classify(body).cls == "complex"


def test_follow_up_to_a_hard_turn_is_complex(clf: Classifier) -> None:
    long_answer = "Here is an implementation using a heap.\n\n```python\n" + \
        "import heapq\n\ndef top_k(nums, k):\n    return heapq.nlargest(k, nums)\n```\n" * 8
    body = chat("Write a function that returns the k largest numbers of a list.", long_answer,
                "Now do it without using any library.")
    assert clf.classify(body).cls == "complex"


def test_small_talk_conversation_stays_simple(clf: Classifier) -> None:
    body = chat("Hello!", "Hi! Nice to meet you.", "Are you a robot?", "I'm an AI assistant.",
                "Cool, thanks!")
    assert clf.classify(body).cls == "simple"


def test_neutral_system_prompt_does_not_change_the_class(clf: Classifier) -> None:
    for prompt, cls in (("Who wrote Hamlet?", "simple"),
                        ("Write a poem about autumn rain.", "complex")):
        assert clf.classify(chat(prompt, system="You are a helpful assistant.")).cls == cls


def test_verdict_carries_score_threshold_features_and_reasons(clf: Classifier) -> None:
    v = clf.classify(chat("Write a Python function to parse ISO dates."))
    assert isinstance(v, Verdict)
    assert 0.0 <= v.score <= 1.0
    assert v.threshold == clf.default_threshold
    assert v.rule is None
    assert v.features["code"] is True and v.features["turns"] == 1
    assert v.reasons and any("code" in r for r in v.reasons)
    json.dumps({"features": v.features, "reasons": v.reasons})      # explain can serialise it


def test_threshold_override(clf: Classifier) -> None:
    body = chat("Who discovered penicillin?")
    assert clf.classify(body, threshold=0.0).cls == "complex"
    assert clf.classify(body, threshold=1.0).cls == "simple"
    assert clf.classify(body, threshold=0.3).threshold == 0.3


# --- rules -------------------------------------------------------------------------------------

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def test_tools_force_complex_by_default(clf: Classifier) -> None:
    v = clf.classify(chat("hi", tools=TOOLS))
    assert (v.cls, v.rule) == ("complex", "tools")
    assert "rule: tools present" in v.reasons
    assert clf.classify(chat("hi", tools=TOOLS), rules=Rules(tools_complex=False)).cls == "simple"


def test_legacy_functions_count_as_tools(clf: Classifier) -> None:
    assert clf.classify(chat("hi", functions=[{"name": "f"}])).rule == "tools"


def test_long_prompt_forces_complex(clf: Classifier) -> None:
    body = chat("What is the title of this text?\n\n" + "All work and no play. " * 400)
    v = clf.classify(body)
    assert (v.cls, v.rule) == ("complex", "prompt_tokens")
    assert v.features["prompt_tokens"] > 1500
    off = clf.classify(body, rules=Rules(complex_over_prompt_tokens=None))
    assert off.rule is None


def test_prompt_token_limit_is_configurable(clf: Classifier) -> None:
    body = chat("Who wrote Hamlet?")
    assert clf.classify(body, rules=Rules(complex_over_prompt_tokens=2)).rule == "prompt_tokens"


def test_response_format_rule_is_on_by_default(clf: Classifier) -> None:
    # The local model refuses every format but text with a 400, so under `auto` such requests must go `complex`.
    for rf in ({"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}, {"type": "json_object"}):
        body = chat("hello", response_format=rf)
        v = clf.classify(body)
        assert (v.cls, v.rule) == ("complex", "response_format")
        assert clf.classify(body, rules=Rules(response_format_complex=False)).rule is None
    plain = chat("hello", response_format={"type": "text"})
    assert clf.classify(plain).rule is None


def test_max_tokens_rule(clf: Classifier) -> None:
    rules = Rules(complex_over_max_tokens=1000)
    assert clf.classify(chat("hello", max_tokens=4000), rules=rules).rule == "max_tokens"
    assert clf.classify(chat("hello", max_completion_tokens=4000), rules=rules).rule == "max_tokens"
    assert clf.classify(chat("hello", max_tokens=100), rules=rules).rule is None
    assert clf.classify(chat("hello", max_tokens=4000)).rule is None      # off by default


# --- odd but valid-shaped input ------------------------------------------------------------------

ODD_BODIES: list[dict[str, Any]] = [
    {"messages": []},
    {"messages": [{"role": "user", "content": ""}]},
    {"messages": [{"role": "user", "content": None}]},
    {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this image?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None,
                   "tool_calls": [{"id": "1", "type": "function",
                                   "function": {"name": "w", "arguments": "{}"}}]},
                  {"role": "tool", "tool_call_id": "1", "content": "{\"temp\": 21}"}]},
    {"messages": [{"role": "user", "content": "東京で一番高い建物は何ですか？"}]},
    {"messages": [{"role": "user", "content": "Пожалуйста, напиши функцию на Python."}]},
    {"messages": [{"role": "user", "content": "🙂" * 50}]},
    {"messages": [{"role": "user", "content": "x" * 100_000}]},
    {"messages": ["not a dict", {"role": "user", "content": "hi"}]},
    {"messages": [{"role": "developer", "content": "Be brief."},
                  {"role": "user", "content": "hi"}]},
    {"prompt": "Once upon a time"},
    {"prompt": ["Say hi", "Say bye"]},
    {"prompt": None},
    {"prompt": [1, 2, 3]},
    {},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": True, "tools": None},
]


@pytest.mark.parametrize("body", ODD_BODIES)
def test_odd_but_valid_input_never_raises(clf: Classifier, body: dict[str, Any]) -> None:
    v = clf.classify(body)
    assert v.cls in ("simple", "complex")
    assert 0.0 <= v.score <= 1.0


def test_legacy_completions_prompt_is_classified(clf: Classifier) -> None:
    assert clf.classify({"prompt": "Hello!"}).cls == "simple"
    code = {"prompt": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"}
    assert clf.classify(code).cls == "complex"


def test_non_english_text_is_flagged(clf: Classifier) -> None:
    v = clf.classify(chat("Quelle est la différence entre été et hiver ? Réponds en français, "
                          "s'il te plaît, avec des détails à propos du climat et des saisons."))
    assert isinstance(v.features["non_english"], bool)
    assert clf.classify(chat("東京で一番高い建物は何ですか？")).features["non_english"] is True


# --- loading -------------------------------------------------------------------------------------

def test_shipped_weights_load_with_a_tuned_threshold(clf: Classifier) -> None:
    assert 0.0 < clf.default_threshold < 1.0
    loso = clf.metadata["loso"]      # the threshold is set on leave-one-source-out scores
    assert loso["complex_recall"] >= clf.metadata["recall_target"]
    assert clf.threshold_for_recall(clf.metadata["recall_target"]) == clf.default_threshold


def test_threshold_for_recall_never_asks_for_less_recall(clf: Classifier) -> None:
    table = clf.recall_thresholds
    assert len(table) >= 5
    thresholds = [t for _, t in table]
    assert thresholds == sorted(thresholds, reverse=True), "more recall, lower threshold"
    (r1, t1), (r2, t2) = table[-3], table[-2]
    assert clf.threshold_for_recall(r1) == t1
    assert clf.threshold_for_recall((r1 + r2) / 2) == t2     # between entries: the next one up
    assert clf.threshold_for_recall(1.5) == min(thresholds)  # past the end: the lowest
    assert clf.threshold_for_recall(None) == clf.default_threshold


def test_weights_without_a_recall_table_use_their_threshold() -> None:
    doc = _good_doc()
    del doc["recall_thresholds"]
    old = Classifier.from_dict(doc)
    assert old.threshold_for_recall(0.99) == old.default_threshold


def test_policy_recall_target_sets_the_runtime_threshold(clf: Classifier) -> None:
    from gateway.config.policy import parse_policy
    from gateway.config.runtime import build_runtime

    base = ("backends:\n  big: {url: 'http://127.0.0.1:1/v1', models: [m]}\n"
            "  small: {url: 'http://127.0.0.1:2/v1', models: [s]}\n"
            "models:\n  auto: {simple: [small], complex: [big]}\n")
    default = build_runtime(parse_policy(base), {}, generation=1)
    assert default.threshold == clf.threshold_for_recall(0.97)
    strict = build_runtime(parse_policy(base + "classifier: {complex_recall_target: 0.99}\n"),
                           {}, generation=1)
    assert strict.threshold == clf.threshold_for_recall(0.99) <= default.threshold
    fixed = build_runtime(parse_policy(
        base + "classifier: {complex_recall_target: 0.99, threshold: 0.6}\n"), {}, generation=1)
    assert fixed.threshold == 0.6                               # an explicit threshold wins


def test_load_accepts_an_explicit_path(tmp_path: Path) -> None:
    shipped = Path(__file__).resolve().parents[1] / "gateway" / "classify" / "weights.json"
    copy = tmp_path / "w.json"
    copy.write_bytes(shipped.read_bytes())
    assert Classifier.load(copy).default_threshold == Classifier.load().default_threshold
    assert Classifier.load(str(copy)).classify(chat("hi")).cls == "simple"


def _good_doc() -> dict[str, Any]:
    shipped = Path(__file__).resolve().parents[1] / "gateway" / "classify" / "weights.json"
    doc: dict[str, Any] = json.loads(shipped.read_text())
    return doc


@pytest.mark.parametrize("mutate, message", [
    (lambda d: d.update(format="other/9"), "format"),
    (lambda d: d.update(weights={}), "weights"),
    (lambda d: d["weights"].update(no_such_feature=1.0), "unknown features"),
    (lambda d: d.update(hash_weights=[]), "hash_weights"),
    (lambda d: d.update(threshold=1.5), "threshold"),
    (lambda d: d.update(threshold="0.3"), "threshold"),
    (lambda d: d.update(bias=None), "finite numbers"),
    (lambda d: d["hash_weights"].__setitem__(0, "x"), "finite numbers"),
    (lambda d: d.update(recall_thresholds=[[0.97]]), "recall_thresholds"),
    (lambda d: d.update(recall_thresholds=[[0.97, 1.5]]), "recall_thresholds"),
    (lambda d: d.update(recall_thresholds={"0.97": 0.3}), "recall_thresholds"),
])
def test_bad_weights_file_raises_value_error(tmp_path: Path, mutate: Any, message: str) -> None:
    doc = _good_doc()
    mutate(doc)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=message) as info:
        Classifier.load(p)
    assert str(p) in str(info.value)


def test_unreadable_or_invalid_files_raise_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read"):
        Classifier.load(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        Classifier.load(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        Classifier.load(bad)


# --- latency smoke check (the real numbers are in bench/classifier.py) ---------------------------

def test_classification_is_fast(clf: Classifier) -> None:
    long_body = chat("Summarize the following report.\n\n" + "Revenue grew 4% in Q3. " * 350)
    for body in (chat("What is the capital of Peru?"), long_body):
        clf.classify(body)
        start = time.perf_counter()
        for _ in range(50):
            clf.classify(body)
        per_call = (time.perf_counter() - start) / 50
        assert per_call < 0.01, per_call     # very loose: the target is well under 1 ms


@pytest.mark.parametrize("fill", ["-", "'", "'-", "- ", "a-", "' "])
def test_no_prompt_makes_the_features_backtrack(fill: str) -> None:
    """The long-form writing pattern let `'` and `-` be separators and words alike: "write" and 25
    dashes split in combinatorially many ways (6.9 s for 31 characters, x17 for each 5 more) on
    the event loop (review helper's repro). Every cue window of such fills now reads at once (the
    bound is not a speed target: the old pattern took hours on these)."""
    from gateway.classify.features import extract

    t0 = time.perf_counter()
    for verb in ("write", "make", "come up with", "tell"):
        for n in (31, 60, 750):
            extract({"messages": [{"role": "user", "content": verb + " " + fill * (n // len(fill))}]})
            extract({"messages": [{"role": "user", "content": (verb + " " + fill * 8 + " ") * (n // 8)}]})
    assert time.perf_counter() - t0 < 2.0
    f = extract({"messages": [{"role": "user", "content": "Write a one-paragraph summary of the plot."}]}).features
    assert f["creative_longform"]  # a hyphenated long-form noun still counts
