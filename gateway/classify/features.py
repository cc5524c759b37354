"""Features of an OpenAI request body for the simple/complex classifier.

Pure Python and stdlib only: the gateway computes these on the hot path. Work is capped so that a
2,000-token prompt costs about as much as a 500-token one: cue words are read from the head and
tail of the final user message, code and math patterns from a bounded window, and the full
length only enters as a number.

The feature names here are the contract between the runtime (`gateway.classify`) and the
training script (`training.classify_train`): both call `extract()`, so they cannot drift apart.
"""

from __future__ import annotations

import math
import re
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.classify.cues import cue_counts
from gateway.wire.tokens import text_tokens

__all__ = ["Extracted", "MODEL_FEATURES", "extract", "hash_index", "request_text"]

# How much of the final user message is read. Long prompts are complex by the size feature (and
# the long-input rule) anyway; reading all of them would only cost time.
CUE_HEAD_CHARS = 500       # the instruction usually sits at the start ...
CUE_TAIL_CHARS = 250       # ... or at the end, after a pasted document or a word problem
SCAN_HEAD_CHARS = 1000     # code / math patterns
SCAN_TAIL_CHARS = 400
PRIOR_TURN_CHARS = 400     # earlier user turns: only their cues matter
HASH_HEAD_WORDS = 40       # n-gram part: the instruction, not the pasted material
HASH_TAIL_WORDS = 12



# Words by str.translate + split (several times faster than a regex): everything but letters,
# digits and the characters of "c++", "c#", "what's", "step-by-step" separates words.
_SEPARATORS = str.maketrans({c: " " for c in "!\"$%&()*,./:;<=>?@[\\]^_`{|}~\t\n\r“”‘…—–"})
_DIGIT_RE = re.compile(r"\d")
_NUMBER_RE = re.compile(r"\d[\d,]*(?:\.\d+)?")
_YEAR_RE = re.compile(r"1[5-9]\d\d|20\d\d")
# A chain of numbers joined by operators: "9 - 2 x 3", "12*7", "3.5 / 7 + 1".
# Never from inside a run of digits: a match there would extend one from the run's start, and
# trying each start backtracked through the whole run (a 1,400-digit prompt held the event loop
# 70 ms a request: review helper's repro). The same matches (a fuzz test holds them to the old).
_ARITH_RE = re.compile(r"(?<!\d)\d+(?:\.\d+)?(?:\s*[-+*/×÷^x]\s*\d+(?:\.\d+)?)+")
# an equation with variables: "x+y = 4z", "2x - 3 = 7", "f(x) = x^2"
_ALGEBRA_RE = re.compile(r"(?:\b\d*[a-z]\b|\))\s*(?:[-+*/^]\s*\w+\s*)*=\s*[-\d(]*[a-z0-9]")
_ARITH_OP_RE = re.compile(r"[-+*/×÷^x]")
_LATEX_RE = re.compile(r"\\(?:frac|sqrt|int|sum|prod|lim|begin|cdot|times|le|ge|pi|alpha|theta)"
                       r"\b|\$[^$\n]{1,80}\$|\\\(|\\\[|[\^_]\{")
# Lines that look like code; anchored at line starts, so cheap on prose.
_CODE_LINE_RE = re.compile(
    r"^[ \t]*(?:def |class |import |from \S+ import|return\b|#include|public |private |static "
    r"|function\b|const |let |var |for ?\(|while ?\(|if ?\(|print\(|console\.|SELECT |"
    r"INSERT |CREATE TABLE|>>> |[}\]];?$)", re.MULTILINE)
_CODE_TOKENS = (";\n", "{\n", ") {", "=>", "):\n", "();", "!= ", "== ")
_TRACE_MARKS = ("Traceback (most recent call last)", "Error:", "Exception:", "\n\tat ",
                "\n    at ", "segmentation fault", "panicked at")
_MONEY_RE = re.compile(r"[$€£¥] ?\d")
_UNIT_RE = re.compile(r"\d\s?(?:%|km|kilometers?|miles?|kg|grams?|pounds|lbs?|hours?|minutes?|"
                      r"seconds?|meters?|feet|inches|liters?|gallons?|mph|cm|mm|°)\b", re.I)
_LONGFORM_NOUNS = (
    "stor(?:y|ies)|poems?|essays?|letters?|e-?mails?|scripts?|dialogues?|dialogs?|songs?|lyrics"
    "|haikus?|limericks?|sonnets?|speech(?:es)?|articles?|blog|narratives?|reports?|reviews?"
    "|screenplays?|jingles?|raps?|fables?|tales?|pitch|biography|monologues?|paragraphs?"
    "|chapters?|novels?|odes?|ballads?|verses?|skits?|conversations?|plays?|cover letter"
    "|recipes?|guides?|tutorials?|itinerar(?:y|ies)|proposals?")
# the long-form noun must be what is written ("write a short story"), not what the output is for
# ("generate a topic sentence for an article", "a closing to a business email"). Separators and
# words are disjoint classes (`'` and `-` belong to words only): where both took them, "write"
# and 25 dashes split in combinatorially many ways and held the event loop for seconds.
_CREATIVE_RE = re.compile(r"\b(?:write|compose|create|draft|craft|generate|pen|produce|tell|make"
                          r"|construct|come up with)\b(?:[^.?!\n\w'-]+(?!(?:for|to|about|of|on|in"
                          r"|into|from|with|that|which|based|like)\b)[\w'-]+){0,6}?(?:[^.?!\n\w'-]+|(?<=\w)-)"
                          r"(?:" + _LONGFORM_NOUNS + r")\b")  # "a one-paragraph summary" too
_LIST_COUNT_RE = re.compile(r"\b(?:list|name|give|suggest|provide|identify|state|generate|recall"
                            r"|brainstorm)\s+(?:me\s+)?(?:\d|one|two|three|four|five|six|a few)\b")
_URL_RE = re.compile(r"\S+://\S+")
# a requested output size: "briefly", "in three sentences", "less than 20 words", "a 5-sentence"
_SHORT_OUTPUT_RE = re.compile(
    r"\b(?:brief|briefly|short|shortly|concise|concisely|succinct|(?:one|two|three|four|five|\d{1,2})"
    r"[- ](?:sentences?|words?|lines?|bullet)|(?:less|fewer|no more|not more) than \d+ words"
    r"|under \d+ words|in a (?:nutshell|sentence|word|phrase))\b")
_NUMBER_WORDS = frozenset("two three four five six seven eight nine ten eleven twelve twenty thirty "
                          "forty fifty hundred thousand twice thrice half third quarter double "
                          "triple dozen".split())
_WH_ANY = frozenset("who what when where which whom whose".split())
_DEFINE_HEADS = frozenset(("what is", "what are", "what's", "who is", "who was", "what does",
                           "describe what", "explain what", "define what", "tell me what",
                           "what was", "what were"))
# answer options given one a line ("A Mother\nB The Man in Black\nC ..."): the answer is a
# letter, a lookup unless a hard cue (math, code, ...) says otherwise
# Numeric options ("A)24\nB)49") are the answers of a computation, not of a lookup.
_CHOICES_RE = re.compile(r"^\(?A[ .):]\s*[^\W\d].*\n\(?B[ .):]\s*[^\W\d].*\n\(?C[ .):]",
                         re.MULTILINE)
# "how do you say X in French", "translate to German: ...": a translation of a short text
_TRANSLATE_RE = re.compile(
    r"\b(?:translat\w*|how (?:do|would|can) (?:you|i|we) say|what's the \w+ for|what is the \w+ for"
    r"|in (?:english|spanish|french|german|italian|portuguese|russian|chinese|japanese|korean"
    r"|arabic|dutch|hindi|turkish|polish|swedish|greek|latin))\b")
_NON_ASCII_LETTER_RE = re.compile(r"[^\x00-\x7f\u2000-\u206f\u00a0-\u00bf]")


def _split_given(text: str, n_words: int) -> tuple[str, int]:
    """(the instruction, the number of words of given material) for a message that pastes
    material before or after a shorter instruction, at any length; (text, 0) otherwise."""
    first_end = text.find("\n\n")
    if first_end < 0:
        colon = text.find(":")    # "Classify these: a, b, c" / "Text: ..." on one line
        if 0 < colon < len(text) - 1 and colon * 2 < len(text) and "?" not in text[colon:]:
            instr = text[:colon]
            return instr, max(n_words - len(instr.split()), 0)
        return text, 0
    last_start = text.rfind("\n\n") + 2
    first, last = text[:first_end], text[last_start:]
    instr = first if len(first) <= len(last) else last
    n_instr = len(instr.split())
    return instr, max(n_words - n_instr, 0)


def _words(lowered: str) -> list[str]:
    return lowered.translate(_SEPARATORS).split()


_WH_START = frozenset("who what when where which whom whose".split())
_HOW_WHY_START = frozenset("how why".split())

# Features the learned scorer uses, in weight order. Others (tools, max_tokens, language, ...)
# are reported for /v1/route/explain and used by rules: the development set has no examples of
# them, so a learned weight would be noise.
MODEL_FEATURES: tuple[str, ...] = (
    "log_tokens", "long_input", "log_final_words", "multi_turn", "log_prior_assistant",
    "prior_hard", "followup", "code_fence", "code_syntax", "code_kw", "stack_trace",
    "docstring", "code", "math", "smalltalk", "numbers", "arith_expr", "trivial_arith", "latex",
    "math_kw", "word_problem",
    "money", "units", "reason_kw", "plan_kw", "creative_longform", "longform_noun",
    "create_verb", "brevity", "oneliner_noun", "explain_kw", "compare_kw", "topic_kw",
    "simple_task", "wh_start", "how_why_start", "short_question", "tips_kw", "list_count",
    "greet", "identity", "feeling", "second_person", "question_marks", "given_input",
    "no_hard", "premise_question", "factoid", "define_q", "short_output", "input_share",
    "given_task",
    # the kinds of complex request that carry no cue word of the groups above
    "open_gen", "gen_object", "counterfactual", "word_math", "conversion", "code_api",
    "code_construct", "puzzle", "plan_question", "roleplay", "discuss", "estimate", "multi_part",
    # simple shapes that hard-task cue words mistake for hard ones (issue 15 follow-up)
    "choices", "translate_short",
)
_ASK_WORDS = frozenset("what why how which who when where".split())

# Words said before the request proper ("please", "can you", "I want you to"): skipped when
# asking whether the request opens with a verb that asks for text.
_LEAD_IN = frozenset("please pls kindly can could would will you i we want need like to me "
                     "us help hey hi hello ok okay now so and also just".split())
_OPEN_VERBS = frozenset("write compose draft create generate invent imagine design develop "
                        "craft produce describe narrate elaborate outline expand tell talk "
                        "teach walk flesh".split())
# numbers written as words, for computations in words ("the product of three, five and seven")
_ALL_NUMBER_WORDS = frozenset(
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen twenty thirty forty fifty sixty seventy eighty ninety "
    "hundred thousand million billion half third quarter twice double triple dozen".split())
# a quantity with a unit to convert, or a unit in the question: "37 cm in feet", "100 F to C"
_CONVERSION_RE = re.compile(
    r"\d\s*(?:°|degrees?\b|[a-z]{1,12}\b).{0,24}?\b(?:in|to|into)\s+(?:°\s*)?(?:celsius|fahrenheit|"
    r"kelvin|[cf]\b|feet|foot|inch(?:es)?|cm|centimet(?:er|re)s?|met(?:er|re)s?|km|kilomet(?:er|re)s?"
    r"|miles?|pounds?|lbs?|kg|kilograms?|ounces?|oz|grams?|lit(?:er|re)s?|gallons?|cups?|mph|"
    r"km/h|yards?|hours?|minutes?|seconds?|days?|weeks?|years?|dollars?|euros?|usd|eur|gbp)\b"
    r"|\bconver(?:t|sion)\b")


@dataclass(slots=True)
class Extracted:
    """What `extract` returns: named features and the hashed n-gram terms."""

    features: dict[str, Any]        # every named feature (model inputs and explain-only ones)
    terms: list[str]                # n-gram terms of the instruction, for hashing and reasons
    prompt_tokens: int
    max_tokens: int | None
    has_tools: bool
    json_schema: bool


def hash_index(term: str, dim: int) -> int:
    """Stable bucket of a term (crc32: same across processes, unlike `hash`)."""
    return zlib.crc32(term.encode("utf-8", "surrogatepass")) % dim


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):   # content parts: keep the text ones (and refusals), skip images/audio
        parts = [p.get("text") if "text" in p else p.get("refusal") for p in content if isinstance(p, Mapping)]
        return "\n".join(p for p in parts if isinstance(p, str))
    return ""


def request_text(body: Mapping[str, Any]) -> tuple[str, list[str], list[str], str, int, int]:
    """Split a chat or completions body into (final user text, earlier user texts, assistant
    texts, system text, total characters, its tokens as `wire.tokens` estimates them)."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        prompt = body.get("prompt")
        if isinstance(prompt, list):
            prompt = "\n".join(p for p in prompt if isinstance(p, str))
        text = prompt if isinstance(prompt, str) else ""
        return text, [], [], "", len(text), text_tokens(text)
    users: list[str] = []
    assistants: list[str] = []
    systems: list[str] = []
    total = tokens = 0
    for m in messages:
        if not isinstance(m, Mapping):
            continue
        text = _content_text(m.get("content"))
        total += len(text)
        tokens += (len(text) + 3) // 4 if text.isascii() else text_tokens(text)  # text_tokens, its common case inline
        role = m.get("role")
        if role == "user":
            users.append(text)
        elif role == "assistant":
            assistants.append(text)
        elif role in ("system", "developer"):
            systems.append(text)
        elif role == "tool":
            assistants.append(text)
    # Without a user turn, the last other text is the request (a task sent as the only system or
    # developer message read as "" and went to the small model: review helper's repro).
    final = users[-1] if users else (assistants[-1] if assistants else (systems[-1] if systems else ""))
    return final, users[:-1], assistants, "\n".join(systems), total, tokens


def _window(text: str, head: int, tail: int) -> str:
    if len(text) <= head + tail:
        return text
    return text[:head] + "\n" + text[-tail:]


def _instruction(text: str) -> str:
    """The instruction part of a message that pastes material before or after it ("Summarize
    this.\n\n<article>", "<passage>\n\nWho ...?"): the shorter of the first and last
    paragraphs when the rest is much longer. Cue words in pasted material say little about
    the task; code and numbers in it are scanned separately."""
    first_end = text.find("\n\n")
    if first_end < 0 or len(text) <= 600:
        return text
    last_start = text.rfind("\n\n") + 2
    first, last = text[:first_end], text[last_start:]
    part = first if len(first.strip()) <= len(last.strip()) else last
    return part if len(part) * 3 <= len(text) else text


_HARD_GROUPS = ("code_kw", "math_kw", "reason_kw", "plan_kw", "explain_kw", "compare_kw",
                "longform_noun")


def _is_hard_turn(text: str) -> bool:
    """A cheap verdict on an earlier user turn: did it ask for something hard?"""
    t = _window(text, PRIOR_TURN_CHARS, 0)
    counts = cue_counts(_words(t.lower()))
    return (any(counts.get(g) for g in _HARD_GROUPS) or "```" in t
            or len(_NUMBER_RE.findall(t)) >= 3)


def _clip(x: float, cap: float) -> float:
    return x / cap if x < cap else 1.0


def extract(body: Mapping[str, Any]) -> Extracted:
    """Compute every named feature of a request body, plus its n-gram terms. Never raises on a
    body of the right general shape; unknown shapes read as empty text."""
    final, prior_users, assistants, system, total_chars, width_tokens = request_text(body)
    prompt_tokens = (total_chars + 3) // 4  # the model's feature: characters, as it was trained on
    cue_text = _instruction(_window(final, CUE_HEAD_CHARS, CUE_TAIL_CHARS))
    scan = _window(final, SCAN_HEAD_CHARS, SCAN_TAIL_CHARS)
    lower = cue_text.lower()
    if "://" in lower:      # a URL names a page, it is not code ("...nytimes.com/...html")
        lower = _URL_RE.sub(" url ", lower)
    words = _words(lower)
    cues = cue_counts(words)
    n_words = len(final.split()) if len(final) <= 4000 else len(final) // 6

    has_digit = _DIGIT_RE.search(scan) is not None
    numbers = _NUMBER_RE.findall(scan) if has_digit else []
    quantities = sum(1 for n in numbers if not _YEAR_RE.fullmatch(n))
    arith = [a for a in _ARITH_RE.findall(scan) if not _YEAR_RE.match(a)] if has_digit else []
    # "what is 2+3": one operator between one-digit numbers is simple by the rubric
    trivial = len(arith) == 1 and len(arith[0].replace(" ", "")) == 3 and quantities <= 2
    code_lines = len(_CODE_LINE_RE.findall(scan)) + sum(1 for t in _CODE_TOKENS if t in scan)
    stripped = final.strip()
    first = words[0] if words else ""
    ends_q = stripped.endswith("?")
    wh_start = first in _WH_START
    multi = len(prior_users) > 0
    prior_hard = any(_is_hard_turn(t) for t in prior_users[-3:])
    prior_asst = max((len(a) for a in assistants), default=0)
    brevity = cues.get("brevity", 0) > 0
    longform = cues.get("longform_noun", 0) > 0
    # numbers in pasted material (dates, populations) are not a problem to solve
    asked = quantities if len(cue_text) * 2 >= len(scan) else sum(
        1 for n in _NUMBER_RE.findall(cue_text) if not _YEAR_RE.fullmatch(n))
    # the instruction and the material it works on ("Summarize this.\n\n<text>"): how much of
    # the request is given input, read the same way for short and long messages
    instr, given_words = _split_given(stripped, n_words)
    if asked and given_words and "\n\n" in stripped:
        # numbers in pasted prose (dates, sizes) are not a problem to solve, unless the
        # instruction asks for math ("Solve this:\n\n<word problem>")
        ic = cue_counts(_words(instr[:CUE_HEAD_CHARS].lower()))
        if not (ic.get("math_kw") or ic.get("math_weak_kw") or ic.get("wordprob_kw")):
            asked = sum(1 for n in _NUMBER_RE.findall(instr[:CUE_HEAD_CHARS])
                        if not _YEAR_RE.fullmatch(n))
    # quantities written out count too ("a third of that", "thrice as much", "three eggs")
    if cues.get("wordprob_kw") or cues.get("math_kw") or cues.get("math_weak_kw"):
        asked += sum(1 for w in words if w in _NUMBER_WORDS)
    math_hits = cues.get("math_kw", 0) + (cues.get("math_weak_kw", 0) if asked else 0)
    word_problem = (asked >= 2 and n_words >= 12
                    and (cues.get("wordprob_kw", 0) > 0 or math_hits > 0))
    lines = final.count("\n") + 1 if final else 0
    code_kw = max(_clip(cues.get("code_kw", 0), 3), float("c++" in lower or "c#" in lower))
    docstring = '"""' in scan or ">>>" in scan
    trace = any(t in scan for t in _TRACE_MARKS)
    fence = "```" in scan
    latex = ("\\" in scan or "$" in scan or "{" in scan) and _LATEX_RE.search(scan) is not None
    arith_expr = (bool(arith) and not trivial) or (
        "=" in scan and not code_lines and _ALGEBRA_RE.search(scan) is not None)
    math_kw = _clip(math_hits, 3)
    greet = cues.get("greet_kw", 0) > 0
    identity = cues.get("identity_kw", 0) > 0
    feeling = cues.get("feeling_kw", 0) > 0
    hard = sum(1 for g in _HARD_GROUPS if cues.get(g))
    creative = not brevity and (_CREATIVE_RE.search(lower) is not None
                                or "write about" in lower or "write an essay" in lower)
    code = code_kw > 0 or fence or docstring or trace or code_lines >= 2
    is_math = math_kw > 0 or latex or arith_expr or word_problem
    # The kinds of complex request that name no code/math/writing cue word (see classify_cues).
    instr_words = [w for w in words[:60] if w not in _LEAD_IN] if words else []
    one_liner = brevity or cues.get("oneliner_noun", 0) > 0
    open_gen = not one_liner and bool(instr_words) and instr_words[0] in _OPEN_VERBS \
        and cues.get("open_verb_kw", 0) > 0
    gen_object = not one_liner and cues.get("gen_object_kw", 0) > 0 and (
        open_gen or cues.get("create_verb", 0) > 0)
    counterfactual = cues.get("counterfactual_kw", 0) > 0
    # quantities next to an operation or unit in words: "the product of 12, 7 and 3", "a
    # triangle with angles of 35 and 75 degrees", "what is 451 times 23"
    spelled = sum(1 for w in words if w in _ALL_NUMBER_WORDS)
    word_math = cues.get("op_word_kw", 0) > 0 and asked + spelled >= 2 and not trivial
    conversion = (has_digit or spelled > 0) and _CONVERSION_RE.search(lower) is not None
    code_api = _clip(cues.get("code_api_kw", 0), 2)
    code_construct = _clip(cues.get("code_construct_kw", 0), 3)
    puzzle = cues.get("puzzle_kw", 0) > 0
    plan_question = cues.get("plan_q_kw", 0) > 0
    roleplay = cues.get("roleplay_kw", 0) > 0
    discuss = cues.get("discuss_kw", 0) > 0
    # estimation: "how many/much/long" about a quantity that has to be reasoned out
    estimate = cues.get("estimate_kw", 0) > 0 and (
        cues.get("lookup_kw", 0) > 0 or "estimate" in words)
    # a question in several parts ("What is X and how does it work?", "Why ...? Was ...?")
    asks = sum(1 for w in words if w in _ASK_WORDS)
    multi_part = cue_text.count("?") >= 2 or asks >= 2
    # nothing in the request asks for code, math, reasoning, planning or long-form writing or
    # analysis (an open question of value or ethics asks for an argued answer)
    no_hard = not (hard or creative or code or is_math or cues.get("topic_kw")
                   or (multi and prior_hard) or open_gen or counterfactual or word_math
                   or conversion or code_api or puzzle or plan_question or estimate or discuss)
    # rubric "short factual lookups": options given, answered with a letter
    choices = not (code or is_math or creative or puzzle or word_math) and "\nB" in final \
        and _CHOICES_RE.search(scan) is not None
    # rubric "translations of a short text" (the hard-task cues "how would you" and "how do"
    # in "how would you say X in Spanish" ask for no plan or explanation)
    translate_short = n_words <= 60 and not code and not is_math \
        and _TRANSLATE_RE.search(lower) is not None
    short_output = brevity or _SHORT_OUTPUT_RE.search(lower) is not None
    instr_n = n_words - given_words
    # a short lookup: a wh-word or "how many/long/..." in a short request with no hard cue
    factoid = no_hard and instr_n <= 20 and (
        any(w in _WH_ANY for w in words[:20]) or cues.get("lookup_kw", 0) > 0)
    # a puzzle's shape: stated premises, then a question about them ("A is the father of B. B is
    # the father of C. What is ...?"), in the user's own words rather than pasted material
    premise_question = ends_q and not given_words and cue_text.count(". ") >= 2 \
        and len(cue_text) < 600
    head2 = " ".join(words[:2])
    # "what is X" is a definition only when nothing asks for a computation, code or analysis
    # ("what is 350 degrees Fahrenheit in Celsius" is a conversion)
    define_q = no_hard and instr_n <= 12 and (head2 in _DEFINE_HEADS or first == "define") \
        and "and" not in words[2:]
    non_ascii = 0 if cue_text.isascii() else len(_NON_ASCII_LETTER_RE.findall(cue_text))

    tools = body.get("tools") or body.get("functions")
    rf = body.get("response_format")
    # any format but plain text (json_object, json_schema, ...): the local model refuses them
    json_schema = isinstance(rf, Mapping) and rf.get("type", "text") != "text"
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = max_tokens if isinstance(max_tokens, int) and not isinstance(max_tokens, bool) \
        else None

    f: dict[str, Any] = {
        # sizes and shape
        "prompt_tokens": prompt_tokens,
        "text_tokens": width_tokens,  # explain only: non-ASCII text by its width (what quotas reserve)
        "log_tokens": math.log1p(prompt_tokens) / 8.0,
        "long_input": prompt_tokens > 1500,
        "final_words": n_words,
        "log_final_words": math.log1p(n_words) / 6.0,
        "turns": len(prior_users) + 1,
        "multi_turn": multi,
        "system_tokens": (len(system) + 3) // 4,
        "log_prior_assistant": math.log1p(prior_asst) / 9.0,
        "prior_hard": prior_hard,
        "followup": multi and cues.get("followup_kw", 0) > 0,
        # code
        "code": code,
        "math": is_math,
        # a very short message with no cue is small talk ("You are stupid"), unless it asks an
        # open question ("What makes art valuable?") or names another hard kind
        "smalltalk": n_words <= 15 and not hard and not creative and not cues.get("topic_kw")
        and not (multi and prior_hard) and not cues.get("create_verb") and (
            not discuss or greet or identity or feeling) and (
            greet or identity or feeling or (n_words <= 6 and not cues.get("simple_task"))),
        "code_fence": fence,
        "code_syntax": _clip(code_lines, 6),
        "code_kw": code_kw,
        "stack_trace": trace,
        "docstring": docstring,
        # math
        "numbers": _clip(quantities, 8),
        "arith_expr": arith_expr,
        "trivial_arith": trivial,
        "latex": latex,
        "math_kw": math_kw,
        "word_problem": word_problem,
        "money": has_digit and _MONEY_RE.search(scan) is not None,
        "units": has_digit and _UNIT_RE.search(scan) is not None,
        # reasoning, planning, long-form writing
        "reason_kw": _clip(cues.get("reason_kw", 0), 2),
        "plan_kw": _clip(cues.get("plan_kw", 0), 2),
        "creative_longform": creative,
        "longform_noun": longform,
        "create_verb": cues.get("create_verb", 0) > 0,
        "brevity": brevity,
        "oneliner_noun": cues.get("oneliner_noun", 0) > 0,
        "explain_kw": _clip(cues.get("explain_kw", 0), 2),
        "compare_kw": cues.get("compare_kw", 0) > 0,
        "topic_kw": cues.get("topic_kw", 0) > 0,
        # the simple side: short tasks, lookups, small talk
        "simple_task": _clip(cues.get("simple_task", 0), 2),
        "wh_start": wh_start,
        "how_why_start": first in _HOW_WHY_START,
        "short_question": n_words <= 12 and (ends_q or wh_start),
        "tips_kw": cues.get("tips_kw", 0) > 0,
        "list_count": _LIST_COUNT_RE.search(lower) is not None,
        "greet": greet,
        "identity": identity,
        "feeling": feeling,
        "second_person": "you" in words or "your" in words,
        "question_marks": _clip(cue_text.count("?"), 3),
        "lines": _clip(lines, 20),
        "given_input": not code_lines and not fence and (
            "\n\n" in stripped or "text:" in lower or stripped.count('"') >= 2),
        # rubric: the simple side's shapes
        "no_hard": no_hard,
        "premise_question": premise_question,
        "factoid": factoid,
        "define_q": define_q,
        "short_output": short_output,
        "input_share": given_words / n_words if given_words and n_words else 0.0,
        "given_task": bool(given_words) and not code_lines and not fence and (
            cues.get("simple_task", 0) > 0 or "?" in instr or cues.get("given_kw", 0) > 0),
        # the kinds of complex request that carry no cue word of the groups above
        "open_gen": open_gen,
        "gen_object": gen_object,
        "counterfactual": counterfactual,
        "word_math": word_math,
        "conversion": conversion,
        "code_api": code_api,
        "code_construct": code_construct,
        "puzzle": puzzle,
        "plan_question": plan_question,
        "roleplay": roleplay,
        "discuss": discuss,
        "estimate": estimate,
        "multi_part": multi_part,
        "choices": choices,
        "translate_short": translate_short,
        # not learned: reported, and used by rules
        "has_tools": bool(tools),
        "json_schema": json_schema,
        "max_tokens": max_tokens if max_tokens is not None else 0,
        "non_english": non_ascii > max(8, len(cue_text) // 10),
    }
    head = words[:HASH_HEAD_WORDS]
    tail = words[-HASH_TAIL_WORDS:] if len(words) > HASH_HEAD_WORDS + HASH_TAIL_WORDS else []
    terms: list[str] = []
    for seq in (head, tail):
        prev = "^" if seq is head else ""
        for w in seq:
            terms.append(w)
            if prev:
                terms.append(prev + " " + w)
            prev = w
    return Extracted(f, terms, prompt_tokens, max_tokens, bool(tools), json_schema)
