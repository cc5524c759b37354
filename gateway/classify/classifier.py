"""Request classifier: is a request `simple` (the small local model answers it well) or `complex`?

A small logistic-regression model over hand-made rubric features (code, math, reasoning,
planning, long-form writing, small talk, size, ...) and hashed word n-grams of the instruction,
trained offline by `training.classify_train` and shipped as `weights.json` beside it. Rules can
force a class before the score is looked at (tools present, very long prompts, ...).

Pure Python: loading reads one small JSON file, and a classification costs tens of
microseconds, a 2,000-token prompt included (see bench/classifier.py).
"""

from __future__ import annotations

import hashlib
import heapq
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeGuard

import orjson

from gateway.classify.features import MODEL_FEATURES, extract, hash_index

__all__ = ["Classifier", "Rules", "Stage", "Verdict", "read_json", "DEFAULT_WEIGHTS", "WEIGHTS_FORMAT"]

DEFAULT_WEIGHTS = Path(__file__).with_name("weights.json")
WEIGHTS_FORMAT = "gateway-classifier/1"
SIMPLE, COMPLEX = "simple", "complex"


@dataclass(frozen=True, slots=True)
class Rules:
    """Rules that force `complex` whatever the score. `None` or `False` turns one off."""

    complex_over_prompt_tokens: int | None = 1500   # estimated prompt tokens above this
    tools_complex: bool = True                      # `tools` / `functions` present
    response_format_complex: bool = True            # a response_format other than text (local refuses it)
    complex_over_max_tokens: int | None = None      # requested max_tokens above this


class Stage(StrEnum):
    """What decided a request's class (explain's `stage`, gateway_classifier_decisions_total)."""

    RULE = "rule"          # a rule forced complex (tools, a long prompt, ...)
    LEXICAL = "lexical"    # the lexical score: outside the cascade's uncertain band, or alone
    ENCODER = "encoder"    # inside the band: the encoder's score blended with the lexical one
    DEADLINE = "deadline"  # inside the band, the encoder too late or too busy: complex (recall first)


@dataclass(frozen=True, slots=True)
class Verdict:
    """The classifier's answer for one request, with what decided it."""

    cls: str                # "simple" | "complex"
    score: float            # model probability that the request is complex, 0..1
    threshold: float
    rule: str | None        # the rule that forced the class, if any
    features: dict[str, float | int | str | bool]
    reasons: list[str] = field(default_factory=list)
    stage: Stage = Stage.LEXICAL
    lexical_score: float | None = None  # set when a later stage decided (score is then its own)
    encoder_score: float | None = None
    # The reason naming the prompt's words that pushed hardest ("top terms: +word ..."), one of
    # `reasons`: shown to the caller (/v1/route/explain), never logged (they are the prompt's,
    # and the request log keeps a prompt only for a tenant whose `log_payloads` says so).
    terms: str | None = None

    def logged(self) -> list[str]:
        """The reasons the request log keeps: all but the prompt's top terms."""
        return self.reasons if self.terms is None else [r for r in self.reasons if r != self.terms]


# Labels for reasons; a feature without one is not worth naming to an operator.
_LABELS: dict[str, str] = {
    "long_input": "long input", "log_tokens": "prompt size", "multi_turn": "multi-turn",
    "log_prior_assistant": "long earlier answers", "prior_hard": "hard earlier turn",
    "followup": "follow-up to earlier turn", "code_fence": "code fence",
    "code_syntax": "code syntax", "code_kw": "code terms", "stack_trace": "stack trace",
    "docstring": "docstring/doctest", "numbers": "numbers", "arith_expr": "arithmetic",
    "trivial_arith": "trivial arithmetic", "latex": "LaTeX", "math_kw": "math terms",
    "word_problem": "word problem", "money": "money amounts", "units": "units",
    "reason_kw": "reasoning cues", "plan_kw": "planning cues",
    "creative_longform": "long-form writing", "longform_noun": "long-form noun",
    "create_verb": "writing verb", "brevity": "brevity constraint",
    "oneliner_noun": "one-line output", "explain_kw": "explain/how/why",
    "compare_kw": "compare/contrast", "topic_kw": "history/impact topic",
    "simple_task": "simple task verb", "wh_start": "wh-question", "how_why_start": "how/why",
    "short_question": "short question", "tips_kw": "tips/ideas list",
    "list_count": "short list", "greet": "greeting", "identity": "about the assistant",
    "feeling": "small talk", "second_person": "addresses the assistant",
    "question_marks": "questions", "lines": "many lines", "given_input": "given input text",
    "log_final_words": "request length", "no_hard": "no hard-task cue", "premise_question": "premises then a question",
    "factoid": "short lookup", "define_q": "what-is/definition", "short_output": "short output asked",
    "input_share": "mostly given text", "given_task": "task on given text",
    "open_gen": "asks for written text", "gen_object": "long-form document",
    "counterfactual": "counterfactual", "word_math": "computation in words",
    "conversion": "unit conversion", "code_api": "framework/API name",
    "code_construct": "programming construct", "puzzle": "puzzle", "plan_question": "planning question",
    "roleplay": "roleplay set-up", "discuss": "open question", "estimate": "estimation",
    "multi_part": "multi-part question", "choices": "answer options given",
    "translate_short": "short translation",
}


class Classifier:
    """A loaded scorer. Immutable after construction; safe to share between requests."""

    __slots__ = ("_weights", "_bias", "_hash_dim", "_hash_weights", "default_threshold",
                 "recall_thresholds", "metadata", "sha256")

    def __init__(self, weights: Mapping[str, float], bias: float, hash_weights: list[float],
                 threshold: float, metadata: Mapping[str, Any] | None = None,
                 recall_thresholds: Sequence[tuple[float, float]] = ()) -> None:
        self._weights = tuple((name, float(w)) for name, w in weights.items() if w)
        self._bias = float(bias)
        self._hash_dim = len(hash_weights)
        self._hash_weights = [float(w) for w in hash_weights]
        self.default_threshold = float(threshold)
        # (complex recall, threshold) pairs measured on leave-one-source-out scores, by recall
        self.recall_thresholds = tuple(sorted((float(r), float(t)) for r, t in recall_thresholds))
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.sha256: str | None = None  # the weights file's digest, when loaded from one

    def threshold_for_recall(self, target: float | None) -> float:
        """The threshold for a target complex recall: the one tabulated for the smallest recall
        at or above the target (recall first: never a higher threshold than the target asks
        for), or the lowest tabulated one past the table's end. The weights' own threshold
        when the target is None or the file has no table."""
        if target is None or not self.recall_thresholds:
            return self.default_threshold
        for recall, threshold in self.recall_thresholds:
            if recall >= target - 1e-9:
                return threshold
        return min(t for _, t in self.recall_thresholds)

    @classmethod
    def load(cls, path: str | os.PathLike[str] | None = None) -> Classifier:
        """Load a weights file (None: the one shipped with the package). Raises ValueError
        naming the file and the problem when it is missing or malformed."""
        p = Path(path) if path is not None else DEFAULT_WEIGHTS
        raw = read_bytes(p, "classifier weights")
        loaded = cls.from_dict(parse_json(raw, p, "classifier weights"), source=str(p))
        loaded.sha256 = hashlib.sha256(raw).hexdigest()  # what the cascade's band was fitted on, or not
        return loaded

    @classmethod
    def from_dict(cls, doc: Any, *, source: str = "<dict>") -> Classifier:
        """Build a classifier from a parsed weights document (see training.classify_train)."""
        def bad(msg: str) -> ValueError:
            return ValueError(f"classifier weights {source}: {msg}")

        if not isinstance(doc, Mapping):
            raise bad("expected a JSON object")
        if doc.get("format") != WEIGHTS_FORMAT:
            raise bad(f"format is {doc.get('format')!r}, expected {WEIGHTS_FORMAT!r}")
        weights = doc.get("weights")
        if not isinstance(weights, Mapping) or not weights:
            raise bad("'weights' must be an object of feature name -> number")
        unknown = sorted(set(weights) - set(MODEL_FEATURES))
        if unknown:
            raise bad(f"unknown features in 'weights': {', '.join(unknown)}")
        hashed = doc.get("hash_weights")
        if not isinstance(hashed, list) or not hashed:
            raise bad("'hash_weights' must be a non-empty list of numbers")
        threshold = doc.get("threshold")
        if not _is_number(threshold) or not 0.0 < threshold < 1.0:
            raise bad(f"'threshold' must be a number between 0 and 1, got {threshold!r}")
        bias = doc.get("bias")
        if not _is_number(bias) or not all(map(_is_number, weights.values())) \
                or not all(map(_is_number, hashed)):
            raise bad("'bias', 'weights' and 'hash_weights' must hold finite numbers")
        table = doc.get("recall_thresholds", [])
        if not isinstance(table, list) or not all(
                isinstance(p, list) and len(p) == 2 and all(map(_is_number, p))
                and 0.0 < p[0] <= 1.0 and 0.0 < p[1] < 1.0 for p in table):
            raise bad("'recall_thresholds' must be a list of [recall, threshold] pairs, "
                      "each number in (0, 1]")
        return cls(weights, bias, hashed, threshold, doc.get("training"),
                   [(p[0], p[1]) for p in table])

    def classify(self, body: Mapping[str, Any], *, threshold: float | None = None,
                 rules: Rules = Rules()) -> Verdict:
        """Classify one parsed OpenAI request body (chat or legacy completions)."""
        ext = extract(body)
        f = ext.features
        contribs: list[tuple[float, str]] = []
        z = self._bias
        for name, w in self._weights:
            x = f[name]
            if x:
                c = w * float(x)
                z += c
                contribs.append((c, _LABELS.get(name, name)))
        terms = ext.terms
        term_contribs: list[tuple[float, str]] = []
        if terms:
            scale = 1.0 / math.sqrt(len(terms))
            hw, dim = self._hash_weights, self._hash_dim
            for t in terms:
                c = hw[hash_index(t, dim)] * scale
                z += c
                term_contribs.append((c, t))
        score = 1.0 / (1.0 + math.exp(-z)) if z > -700 else 0.0
        thr = self.default_threshold if threshold is None else threshold

        rule = _forced(ext.features, rules)
        cls = COMPLEX if rule is not None or score >= thr else SIMPLE
        top = _terms(cls, term_contribs)
        return Verdict(cls, score, thr, rule, f, [*_reasons(cls, rule, contribs), *([top] if top else [])],
                       Stage.LEXICAL if rule is None else Stage.RULE, terms=top)


def read_bytes(p: Path, what: str) -> bytes:
    """A file's bytes; ValueError naming `what`, the file and the problem otherwise."""
    try:
        return p.read_bytes()
    except OSError as e:
        raise ValueError(f"{what} {p}: cannot read: {e.strerror or e}") from e


def parse_json(raw: bytes, p: Path, what: str) -> Any:
    """`raw`, read from `p`, as JSON; ValueError naming `what`, the file and the problem otherwise."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ValueError(f"{what} {p}: not valid JSON: {e}") from e


def read_json(p: Path, what: str) -> Any:
    """A JSON file's document; ValueError naming `what`, the file and the problem otherwise."""
    return parse_json(read_bytes(p, what), p, what)


def _is_number(x: Any) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _forced(f: Mapping[str, Any], rules: Rules) -> str | None:
    """The name of the first rule that forces `complex`, or None."""
    if rules.tools_complex and f["has_tools"]:
        return "tools"
    if rules.response_format_complex and f["json_schema"]:
        return "response_format"
    if rules.complex_over_prompt_tokens is not None \
            and f["prompt_tokens"] > rules.complex_over_prompt_tokens:
        return "prompt_tokens"
    if rules.complex_over_max_tokens is not None \
            and f["max_tokens"] > rules.complex_over_max_tokens:
        return "max_tokens"
    return None


_RULE_REASONS = {
    "tools": "rule: tools present",
    "response_format": "rule: response_format other than text",
    "prompt_tokens": "rule: long prompt",
    "max_tokens": "rule: large max_tokens",
}


def _reasons(cls: str, rule: str | None, contribs: list[tuple[float, str]]) -> list[str]:
    """A few short reasons: the rule, then the features that pushed hardest toward the chosen class."""
    sign = 1.0 if cls == COMPLEX else -1.0
    out = [_RULE_REASONS[rule]] if rule else []
    top = heapq.nlargest(3, ((sign * c, label) for c, label in contribs))
    out += [label for c, label in top if c > 0.05]
    return out


def _terms(cls: str, term_contribs: list[tuple[float, str]]) -> str | None:
    """The reason naming the prompt's three terms that pushed hardest toward the chosen class."""
    sign = 1.0 if cls == COMPLEX else -1.0
    best: dict[str, float] = {}
    for c, t in term_contribs:
        if sign * c > max(best.get(t, 0.0), 0.02):
            best[t] = sign * c
    terms = [("+" if sign > 0 else "-") + t for t in heapq.nlargest(3, best, key=best.__getitem__)]
    return "top terms: " + " ".join(terms) if terms else None
