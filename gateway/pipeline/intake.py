"""The intake stage: who asks (authenticate), what (parse, authorize), which route, which class
(classify) and which place in the queues (band, deadline, token cost). Nothing is held yet."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import orjson

from ..admission.gate import MAX_COST, Ticket
from ..classify.classifier import Stage, Verdict
from ..classify.features import CUE_HEAD_CHARS, CUE_TAIL_CHARS
from ..config.policy import QuotaPolicy
from ..config.runtime import Route, Runtime
from ..routing.prefix import prefix_keys
from ..tenants.auth import Tenant
from ..tenants.priority import asked_band, cap
from ..wire.codec import validate_legs
from ..wire.openai_wire import parse_body
from ..wire.tokens import bytes_tokens
from .call import Call

__all__ = ["intake", "parse", "verdict_view"]

# A request's answer tokens when it sets no limit and its tenant has no quota: what a quota
# reserves by default (`quota.default_max_tokens`), read from the policy model, not copied.
_DEFAULT_ANSWER_TOKENS: int = QuotaPolicy.model_fields["default_max_tokens"].default


def parse(call: Call, max_items: int | None = None) -> None:
    """Validate the body (at most `max_items` items: server.max_items) and fill in the call's
    model, stream flag and the band it asks for (x-priority when sent, else its service_tier's;
    the tenant's ceiling applies later)."""
    typed, body = parse_body(call.raw, call.endpoint.request, max_items)
    call.body = body
    call.model = typed.model
    call.stream = bool(getattr(typed, "stream", False)) and call.endpoint.streams
    call.asked.priority = asked_band(call.asked.priority, body)


async def intake(call: Call, rt: Runtime) -> tuple[Route, Tenant]:
    """The request's tenant and route, its class and its ticket; raises the GatewayError that
    refuses it (Unauthorized, BadRequest, Forbidden, NotFound). Waits only for the classifier's
    encoder, on a request the lexical scorer is unsure of (bounded by its deadline)."""
    # The HTTP edge authenticated the key already (against this runtime) before reading the body.
    tenant = call.tenant if call.tenant is not None else rt.tenants.authenticate(call.api_key)
    call.tenant = tenant
    parse(call, rt.server.max_items)
    if tenant.log_payloads:  # the request log keeps its answer: captured as the cache would
        call.cache.capture = rt.policy.cache.max_entry_bytes
    rt.tenants.authorize(tenant, call.model)
    cap(call, tenant)  # the band at most the tenant's priority; a service_tier above it not sent upstream
    route = rt.route(call.model)
    # The whole body's size (cheap): everything it carries that a model reads, but base64 images
    # and audio, counted by what they are (_media). Token ids are counted one by one.
    unread = call.endpoint.unread_prompt(call.body)
    media_bytes, media = _media(call.body) if call.endpoint.generates else (0, 0)
    whole = max(0, bytes_tokens(call.raw) - media_bytes)
    call.prompt_tokens = max(whole + media, unread)
    if call.endpoint.classifies:
        view = call.endpoint.classify_view(call.body)  # a translation for some endpoints: once
        verdict = rt.classify(view, route)
        estimate = verdict.features.get("text_tokens")
        hidden = 0
        if isinstance(estimate, int):
            read = estimate + _structured_tokens(view)  # what the text does not show is _unread's
            # Never below the body's size: the classifier reads only the text it models (a
            # 50,000-token prompt in an item it skips was reserved 6 tokens: review helper's repro).
            call.prompt_tokens = max(whole, read + unread) + media
            verdict = _long(verdict, read, rt.rules.complex_over_prompt_tokens)
            hidden = _hidden(whole - read - unread, read)
        # A batch of prompts is read joined, and the encoder reads only its first and last tokens.
        batch = call.endpoint.batch_chars(call.body)
        if rt.uncertain(verdict, route) and not unread and not hidden and not batch:
            verdict = await rt.cascade.decide(verdict, view, tenant.name)
        if unread:
            verdict = _unread(verdict, f"{unread} prompt tokens given as token ids or a suffix: the classifier reads text only")
        elif hidden:
            verdict = _unread(verdict, f"~{hidden} prompt tokens in parts of the body the classifier does not read")
        elif batch > _BATCH_READ_CHARS:
            verdict = _unread(verdict, f"a batch of prompts ({batch} characters) longer than the classifier reads of it")
        call.verdict = verdict
    if route.prefixes is not None and call.endpoint.generates:
        _prefix(call, route, tenant)  # may make it complex (sticky_class): the class is final after it
    if call.endpoint.client_prefill and call.endpoint.ends_in_prefill(call.body):
        route = route.prefilled(call.cls, call.endpoint.name)  # only backends that continue it
    pool = route.pool(call.cls, call.endpoint.name)  # an endpoint no candidate serves: a 400 now, no upstream call
    # A candidate reached through translation: what cannot be faithful is a 400 now too.
    validate_legs(pool.translating.get(call.endpoint.name, ()), call.body)
    _ticket(call, rt, tenant)
    return route, tenant


_STRUCTURED = ("tools", "functions", "response_format")


def _structured_tokens(view: Mapping[str, Any]) -> int:
    """Prompt tokens the classifier's estimate (the messages' text) leaves out: tool and function
    definitions, a response schema, and the calls earlier turns made (their arguments), as the
    tokens of their JSON. A prompt big in `tools` looked like a 20-token one: its
    second-long prefill raised its backend's predicted TTFT for every prompt and moved the other
    tenants' traffic (review helper's repro). Images are not counted (their JSON is no measure)."""
    parts = [view[k] for k in _STRUCTURED if view.get(k)]
    messages = view.get("messages")
    if isinstance(messages, list):
        parts.extend(calls for m in messages if isinstance(m, Mapping) and (calls := m.get("tool_calls") or m.get("function_call")))
    if not parts:
        return 0
    try:
        return bytes_tokens(orjson.dumps(parts))
    except orjson.JSONEncodeError:  # nested too deeply: the body cannot be sent on either (a 400 there)
        return 0


def _long(v: Verdict, tokens: int, limit: int | None) -> Verdict:
    """The long-prompt rule on the whole prompt estimate: the classifier counts the messages'
    text, not the tool calls earlier turns made nor the tools (a chat whose history held 45,000
    tokens of tool-call arguments was simple and went to the small model: review helper's repro)."""
    if v.cls == "complex" or limit is None or tokens <= limit:
        return v
    # The top terms the scorer named pushed toward simple: not this verdict's reasons.
    return replace(v, cls="complex", rule="prompt_tokens", stage=Stage.RULE, terms=None,
                   reasons=[*v.logged(), f"rule: long prompt ({tokens} tokens with its tool definitions and calls)"])


def _unread(v: Verdict, why: str) -> Verdict:
    """A prompt the classifier could not read whole (token ids, a completion's suffix: 30,000
    token ids were "simple", sent to the small model, and reserved none of their tokens; a
    50,000-token tool output it skips): complex, recall first."""
    if v.cls == "complex":
        return v
    return replace(v, cls="complex", rule="unread_prompt", stage=Stage.RULE, reasons=[*v.reasons, why])


# A batch of prompts longer than this is not read whole: the cue phrases come from the head and
# the tail of the text (a hard prompt 81st of 121 short ones went to the small model: review
# helper's repro).
_BATCH_READ_CHARS = CUE_HEAD_CHARS + CUE_TAIL_CHARS

# The body's tokens the classifier does not read that make a prompt unread (`_hidden`): more than
# the keys and punctuation of an ordinary request's JSON (~10 tokens a message; ~100 messages).
_HIDDEN_MIN_TOKENS = 1024


def _hidden(unseen: int, read: int) -> int:
    """`unseen` (the body's tokens less what the classifier read) when they make a significant
    share of the prompt: over _HIDDEN_MIN_TOKENS and more than it read; else 0. A prompt is
    not simple by the part the classifier read when most of it is in parts it skips (items and
    parts of kinds it does not model, a file's data, a template's variables)."""
    return unseen if unseen > _HIDDEN_MIN_TOKENS and unseen > read else 0


# A base64 image counts as at most this many prompt tokens: a model reads its pixels, not its
# characters (a provider counts an image by its size in pixels, at most ~1,100-2,500 tokens; the
# JSON of a 1 MB one is 330,000 characters). Audio counts one token per _AUDIO_CHARS characters of
# its base64 (~40 a second of 16 kHz WAV, ~20 of MP3: providers count ~10). A file's data counts
# whole (its text, or its pages' text and images, are read).
_MEDIA_TOKENS = 2048
_AUDIO_CHARS = 1024
_TEXT_PARTS = frozenset({"text", "input_text", "output_text"})  # most parts: nothing to look into
_IMAGE_PARTS = frozenset({"image_url", "input_image", "computer_screenshot"})  # chat's, Responses' (an image URL)


def _media(body: Mapping[str, Any]) -> tuple[int, int]:
    """(the tokens the base64 images and audio of a body would count as text, the tokens they
    count as), from the parts of its turns or items (chat, Messages, Responses) and of a prompt
    template's variables: as many steps as parts, whatever the size of the text."""
    turns = body.get("messages")
    if not isinstance(turns, list):
        turns = body.get("input")
    found: list[tuple[int, int]] = []
    if isinstance(turns, list):
        for turn in turns:
            if turn.__class__ is not dict:
                continue
            content = turn.get("content")
            if content.__class__ is str and "type" not in turn:
                continue  # a chat turn of text: the most common by far
            if isinstance(content, list):
                _media_in(content, found, 2)
            output = turn.get("output")  # a function call's output: parts too
            if isinstance(output, list | dict):
                _media_in(output, found, 2)
            if turn.get("type") == "image_generation_call" and isinstance(image := turn.get("result"), str):
                found.append(_image(image))  # an image made earlier, given back
    prompt = body.get("prompt")
    if prompt.__class__ is dict and isinstance(variables := prompt.get("variables"), dict):
        _media_in(list(variables.values()), found, 0)
    if not found:  # most requests: no generator to make
        return 0, 0
    return sum(t for t, _ in found), sum(c for _, c in found)


def _media_in(parts: list[Any] | dict[str, Any], found: list[tuple[int, int]], depth: int) -> None:
    """Appends to `found` (tokens as text, tokens counted) for each image or audio among `parts`
    (a part or a list of them) and in the parts they hold (a tool result's `content`, an
    Anthropic block's `source`), `depth` levels down."""
    for part in parts if isinstance(parts, list) else (parts,):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or kind in _TEXT_PARTS:  # (an Anthropic source has a type too)
            continue
        if kind in _IMAGE_PARTS:
            url = part.get("image_url")  # chat's {"url": ...}; Responses' input_image and screenshots: the URL
            if isinstance(url, dict):
                url = url.get("url")
            if isinstance(url, str) and url.startswith("data:"):
                found.append(_image(url))
            continue
        if kind == "base64":  # an Anthropic source (a document's is a file: read, counted whole)
            media_type, data = part.get("media_type"), part.get("data")
            if isinstance(media_type, str) and media_type.startswith("image/") and isinstance(data, str):
                found.append(_image(data))
            continue
        if kind == "input_audio":
            audio = part.get("input_audio")
            data = audio.get("data") if isinstance(audio, dict) else None
            if isinstance(data, str):
                found.append((len(data) // 4, len(data) // _AUDIO_CHARS))
            continue
        if depth > 0:
            for key in ("content", "source"):
                child = part.get(key)
                if isinstance(child, list | dict):
                    _media_in(child, found, depth - 1)


def _image(data: str) -> tuple[int, int]:
    tokens = len(data) // 4
    return tokens, min(tokens, _MEDIA_TOKENS)


def _prefix(call: Call, route: Route, tenant: Tenant) -> None:
    """The prompt's block keys, for prefix affinity; and a conversation answered in `complex`
    before stays there (routing.prefix_affinity.sticky_class): a follow-up the classifier finds
    simple is part of a hard conversation, and bouncing between models turn by turn would cost
    each model's prompt cache (and the answer's consistency)."""
    pa = route.routing.prefix_affinity
    call.prefix = keys = prefix_keys(call.endpoint.classify_view(call.body), pa.block_chars, tenant.cache_namespace)
    v = call.verdict
    if v is None or v.cls != "simple" or not route.split or not pa.sticky_class or route.prefixes is None:
        return
    if route.prefixes.previous_class(keys) == "complex":
        call.verdict = replace(v, cls="complex", rule=v.rule or "sticky_class", stage=Stage.RULE,
                               reasons=[*v.reasons, "sticky: an earlier turn of this conversation was answered as complex"])


def _ticket(call: Call, rt: Runtime, tenant: Tenant) -> None:
    """The call's place in the queues: its band (already held to the tenant's ceiling by
    priority.cap), its band's default deadline, its token cost."""
    band = call.asked.priority or "default"
    if not call.asked.deadline:
        band_ms = getattr(rt.policy.admission.deadline_ms, band)
        if band_ms is not None:
            call.deadline = min(call.deadline, call.timing.t0_monotonic + band_ms / 1000)
    # What the answer may cost: without a limit, what the tenant's quota reserves for one (a
    # request must not take a smaller share by leaving max_tokens out); n answers cost n times.
    answer = call.max_output_tokens()
    if answer is None:
        tp = rt.policy.tenants.get(tenant.name)
        answer = tp.quota.default_max_tokens if tp is not None and tp.quota is not None else _DEFAULT_ANSWER_TOKENS
    answer *= call.answers()
    # A base per request, so tiny requests do not take many turns each (DRR shares tokens).
    cost = 256 + call.prompt_tokens + answer
    call.ticket = Ticket(band, tenant.name, min(max(1, cost), MAX_COST), rt.tenants.weight(tenant.name))


def verdict_view(call: Call, tenant: Tenant) -> dict[str, Any]:
    """The stage's part of /v1/route/explain: who, which band, which class and why."""
    v = call.verdict
    return {
        "endpoint": call.endpoint.name,
        "model": call.model,
        "tenant": tenant.name,
        "priority": call.asked.priority,
        "priority_ceiling": tenant.priority,  # the tenant's `priority`: the most a request may ask for
        "service_tier_upstream": call.body.get("service_tier"),  # what a backend would be sent (None: none)
        "class": call.cls if v is None else v.cls,
        # which stage decided (rule, lexical, encoder, deadline), and that stage's score
        "stage": None if v is None or not v.features else v.stage.value,
        "score": None if v is None else round(v.score, 4),
        "threshold": None if v is None else round(v.threshold, 4),
        "lexical_score": None if v is None else round(v.score if v.lexical_score is None else v.lexical_score, 4),
        "encoder_score": None if v is None or v.encoder_score is None else round(v.encoder_score, 4),
        "rule": None if v is None else v.rule,
        "reasons": call.reasons if v is None else v.reasons,
        "features": {} if v is None else v.features,
        "prompt_tokens": call.prompt_tokens,
    }
