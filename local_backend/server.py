"""The aiohttp OpenAI-compatible server over one Engine."""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import orjson
from aiohttp import web

from .prompts import encode_chat, encode_completion
from .logprobs import TextOffsets, chat_logprobs, completion_logprobs
from .protocol import Delta, EngineClosed, GenerationRequest, QueueFull, SamplingParams, Sequence, TokenLogprob, TooLong
from .wire import (
    SSE_DONE,
    ApiError,
    ChatRequest,
    CompletionRequest,
    chat_choice,
    chat_chunk,
    chat_response,
    completion_choice,
    completion_chunk,
    completion_response,
    parse_request,
    sse,
    usage,
)

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ["HEALTH_TOKEN_ENV", "STATE", "BackendState", "SamplingDefaults", "create_app", "sampling_defaults"]

# Set by a gateway that launches this server (gateway/process/launcher.py): its /healthz then
# proves the answer comes from this launch, as HMAC-SHA256(token, X-Health-Nonce) in X-Health-Proof.
HEALTH_TOKEN_ENV = "LOCAL_BACKEND_HEALTH_TOKEN"
_NONCE_MAX_CHARS = 256  # a launcher's nonce is ~22; a longer one is ignored (no proof)

log = logging.getLogger("local_backend.server")

_T = TypeVar("_T")
_R = TypeVar("_R", ChatRequest, CompletionRequest)


@dataclass
class BackendState:
    """What the handlers share: the engine once loaded, and the serving defaults."""

    served_name: str
    engine: Engine | None = None
    load_error: str | None = None
    default_max_tokens: int = 512
    # The most tokens one request may generate; more is clamped (finish_reason "length" there). A request's
    # prompt + max_tokens is what it reserves of the KV budget, so max_tokens=10**9 would hold the whole
    # context and keep others waiting for the length of its answer.
    max_tokens_cap: int = 2048
    default_temperature: float = 0.0  # for a request without temperature: see sampling_defaults()
    default_top_p: float = 1.0
    body_limit_bytes: int = 1 << 20
    # Bytes of request bodies whose prompts wait for (or are in) the one tokenizer thread. A
    # prompt costs about 1.6 s a MB to tokenize before its length can be refused, so past twice
    # the body limit waiting, a request is refused at once (429) instead of queueing behind them.
    tokenizing_bytes: int = 0
    created: int = field(default_factory=lambda: int(time.time()))
    # The launching gateway's per-launch secret ($LOCAL_BACKEND_HEALTH_TOKEN); None when run by hand.
    health_token: str | None = field(default=None, repr=False)


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """What a request that names no temperature / top_p is decoded with, and where each came from."""

    temperature: float
    top_p: float
    temperature_from: str
    top_p_from: str

    def describe(self) -> str:
        greedy = " (greedy)" if self.temperature == 0 else ""
        return f"temperature {self.temperature:g}{greedy} from {self.temperature_from}, top_p {self.top_p:g} from {self.top_p_from}"


def sampling_defaults(
    temperature: float | None, top_p: float | None, generation_config: Mapping[str, Any] | None
) -> SamplingDefaults:
    """Each default: the command line's when given; else the model's generation config's when it
    samples (`do_sample: true`, as vLLM's `--generation-config auto` reads it); else greedy
    (temperature 0) and top_p 1. A gateway that launches the server always passes the temperature,
    so its cache and the server agree."""
    config = generation_config or {}
    samples = config.get("do_sample") is True

    def pick(flag: float | None, key: str, low: float, fallback: float) -> tuple[float, str]:
        if flag is not None:
            return flag, f"--default-{key.replace('_', '-')}"
        value = config.get(key)
        if samples and isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= (2.0 if key == "temperature" else 1.0):
            return float(value), "the model's generation config (do_sample: true)"
        return fallback, "the built-in default" if not samples else f"the built-in default (the generation config sets no usable {key})"

    t, t_from = pick(temperature, "temperature", 0.0, 0.0)
    p, p_from = pick(top_p, "top_p", 1e-9, 1.0)
    return SamplingDefaults(t, p, t_from, p_from)


STATE = web.AppKey("state", BackendState)
# Tokenization runs here, one prompt at a time: it bounds the memory prompts being tokenized hold, and
# the tokenizer's split-special-tokens switch (used to encode control tokens in messages as text) is
# state shared by every call, which concurrent calls would race on.
TOKENIZER_THREAD = web.AppKey("tokenizer_thread", ThreadPoolExecutor)
_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(obj), status=status, content_type="application/json", headers=headers)


async def _whole_answer(build: Callable[[], dict[str, Any]], *, off_loop: bool) -> web.Response:
    """A whole answer as JSON. With log probabilities it is built and encoded in a thread: 8
    choices of 2,048 tokens with 20 alternatives each are ~350k objects and 30 MB, 1.6 s of
    Python that would hold every other request's event loop (a thread gives it back at each of
    the GIL's switches)."""
    body = await asyncio.to_thread(lambda: orjson.dumps(build())) if off_loop else orjson.dumps(build())
    return web.Response(body=body, content_type="application/json")


def _error_response(err: ApiError) -> web.Response:
    return web.Response(body=err.body(), status=err.status, content_type="application/json", headers=err.headers)


@web.middleware
async def _errors(request: web.Request, handler: _Handler) -> web.StreamResponse:
    """Every error leaves in OpenAI's shape (streams commit their status first and never get here)."""
    try:
        return await handler(request)
    except ApiError as err:
        return _error_response(err)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = "not_found_error" if exc.status == 404 else "invalid_request_error"
        return _error_response(ApiError(exc.status, f"{request.method} {request.path}: {exc.reason}", type=kind))
    except Exception:
        log.exception("unhandled error on %s", request.path)
        return _error_response(ApiError(500, "internal error in the local backend", type="server_error"))


async def _read_body(request: web.Request, limit: int) -> bytes:
    too_big = ApiError(413, f"request body larger than {limit} bytes", code="request_too_large")
    if request.content_length is not None and request.content_length > limit:
        raise too_big
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise too_big from None


def _engine_for(state: BackendState, model: str) -> Engine:
    if state.engine is None:
        raise ApiError(503, "the model is still loading", type="server_error", code="model_loading", headers={"Retry-After": "1"})
    if model != state.served_name:
        raise ApiError(
            404,
            f"The model '{model}' does not exist; this server serves '{state.served_name}'",
            param="model",
            code="model_not_found",
        )
    return state.engine


async def _submit(state: BackendState, engine: Engine, ids: list[int], req: ChatRequest | CompletionRequest, param: str) -> list[Sequence]:
    """One sequence per choice (`n`), choice i seeded `seed + i` when a seed is given; all or none
    (a later one refused cancels those already queued)."""
    if len(ids) >= engine.context_length:
        raise ApiError(
            400,
            f"{param}: the prompt has {len(ids)} tokens; this model's context is {engine.context_length}",
            param=param,
            code="context_length_exceeded",
        )
    temperature = state.default_temperature if req.temperature is None else req.temperature
    top_p = state.default_top_p if req.top_p is None else req.top_p
    bias, logprobs = req.bias_pairs(engine.vocab_size), req.logprob_count()
    limit = min(req.token_limit() or state.default_max_tokens, state.max_tokens_cap)
    seqs: list[Sequence] = []
    try:
        for i in range(req.n):
            sampling = SamplingParams(
                temperature=temperature,
                top_p=top_p,
                seed=None if req.seed is None else req.seed + i,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                logit_bias=bias,
                logprobs=logprobs,
            )
            seqs.append(engine.submit(GenerationRequest(ids, limit, sampling, req.stop_sequences(), req.ignore_eos, req.cache_salt or "")))
        return seqs
    except QueueFull as exc:
        raise ApiError(429, f"the local model is busy: {exc}", type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"}) from None
    except TooLong as exc:  # prompt + max_tokens beyond what the KV cache may hold for one sequence
        raise ApiError(400, f"{param}: {exc}", param=param, code="context_length_exceeded") from None
    except EngineClosed as exc:
        raise ApiError(503, str(exc), type="server_error", code="shutting_down") from None
    finally:
        if len(seqs) < req.n:  # a later choice was refused: none of them runs
            for seq in seqs:
                seq.cancel()


async def _collect(seq: Sequence) -> tuple[str, Delta, list[TokenLogprob]]:
    """The whole answer: its text, its last delta (finish, usage) and every token's log probability asked for."""
    parts: list[str] = []
    logprobs: list[TokenLogprob] = []
    async for delta in seq.deltas():
        parts.append(delta.text)
        logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            return "".join(parts), delta, logprobs
    raise EngineClosed("the sequence ended without a finish reason")


async def _merged(seqs: list[Sequence]) -> AsyncGenerator[tuple[int, Delta], None]:
    """The deltas of every choice as they come, each with its choice's index, until all finished."""
    if len(seqs) == 1:  # the common case: no tasks
        async for delta in seqs[0].deltas():
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, Delta | BaseException]] = asyncio.Queue()

    async def pump(i: int, seq: Sequence) -> None:
        try:
            async for delta in seq.deltas():
                queue.put_nowait((i, delta))
        except Exception as exc:  # noqa: BLE001 - handed to the reader, which raises it
            queue.put_nowait((i, exc))

    tasks = [asyncio.create_task(pump(i, seq)) for i, seq in enumerate(seqs)]
    try:
        left = len(seqs)
        while left:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            yield i, item
            left -= item.finish_reason is not None
    finally:
        for task in tasks:
            task.cancel()


async def _stream(
    request: web.Request,
    seqs: list[Sequence],
    frame: Callable[[int, Delta, bool], list[bytes]],
    tail: Callable[[int, int], list[bytes]],
) -> web.StreamResponse:
    """Relay every choice's deltas as SSE (`frame(index, delta, first of its choice)`), then
    `tail(prompt tokens, completion tokens)` once all finished. Headers go out with the first
    token, so a failure before it is a clean error."""
    deltas = _merged(seqs)
    try:
        first = await anext(deltas)
    except (EngineClosed, StopAsyncIteration) as exc:
        raise ApiError(503, f"generation stopped: {exc}", type="server_error") from None
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    started: set[int] = set()
    prompt = completion = 0
    try:
        item: tuple[int, Delta] | None = first
        while item is not None:
            i, delta = item
            await resp.write(b"".join(frame(i, delta, i not in started)))
            started.add(i)
            if delta.finish_reason is not None:
                prompt, completion = delta.prompt_tokens, completion + delta.completion_tokens
            item = await anext(deltas, None)
        await resp.write(b"".join(tail(prompt, completion)) + SSE_DONE)
        await resp.write_eof()
    except ConnectionResetError:
        pass  # the client left; the handler's `finally` frees the slots
    except Exception as exc:  # too late for a status code: tell the client in-band
        log.warning("stream failed after its first token: %s", exc)
        error = {"message": str(exc), "type": "server_error", "param": None, "code": None}
        try:
            await resp.write(sse({"error": error}) + SSE_DONE)
        except ConnectionResetError:
            pass
    finally:
        await deltas.aclose()
    return resp


async def _collect_all(seqs: list[Sequence]) -> tuple[list[tuple[str, Delta, list[TokenLogprob]]], dict[str, int]]:
    """Every choice's whole answer, and the usage of them all (the prompt counted once)."""
    tasks = [asyncio.ensure_future(_collect(seq)) for seq in seqs]
    try:
        answers = list(await asyncio.gather(*tasks))
    finally:  # one choice failed (or the client left): the others' waits end with it
        for task in tasks:
            task.cancel()
    return answers, usage(answers[0][1].prompt_tokens, sum(last.completion_tokens for _, last, _ in answers))


async def _tokenize(request: web.Request, encode: Callable[..., list[int]], engine: Engine, req: ChatRequest | CompletionRequest,
                    size: int) -> list[int]:
    """Run ``encode`` on the app's tokenizer thread, with the engine's pre-tokenization length check."""
    call = functools.partial(encode, engine.tokenizer, req, max_chars=engine.longest_token_chars, context_length=engine.context_length)
    return await _on_tokenizer_thread(request, call, size)


async def _parse(request: web.Request, model: type[_R], body: bytes) -> _R:
    """Validate a body on the tokenizer thread: a megabyte of small messages or content parts
    costs the validator tens of ms or more, which on the event loop held every stream and the
    health checks (24 clients sending such bodies: /healthz 4.9 s, and the launcher restarts a
    server whose health checks take 3 s; review helper's repro)."""
    return await _on_tokenizer_thread(request, functools.partial(parse_request, model, body), len(body))


async def _on_tokenizer_thread(request: web.Request, call: Callable[[], _T], size: int) -> _T:
    """Run ``call`` on the app's tokenizer thread; a 429 when the bodies waiting for that thread
    (`size` bytes this one) pass twice the body limit: one caller's large prompts cannot hold
    every other caller's behind them."""
    state = request.app[STATE]
    if state.tokenizing_bytes and state.tokenizing_bytes + size > 2 * state.body_limit_bytes:
        raise ApiError(429, f"the local model is busy: {state.tokenizing_bytes} bytes of prompts wait to be tokenized",
                       type="rate_limit_error", code="queue_full", headers={"Retry-After": "1"})
    state.tokenizing_bytes += size
    try:
        return await asyncio.get_running_loop().run_in_executor(request.app[TOKENIZER_THREAD], call)
    finally:
        state.tokenizing_bytes -= size


def _rid(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/chat/completions"""
    state = request.app[STATE]
    body = await _read_body(request, state.body_limit_bytes)
    req = await _parse(request, ChatRequest, body)
    refusal = req.unsupported()
    if refusal is not None:
        raise refusal
    engine = _engine_for(state, req.model)
    ids = await _tokenize(request, encode_chat, engine, req, len(body))
    seqs = await _submit(state, engine, ids, req, "messages")
    rid, created, name = _rid("chatcmpl"), int(time.time()), state.served_name
    wants_logprobs = req.logprob_count() is not None
    with_usage = req.include_usage
    try:
        if not req.stream:
            answers, use = await _collect_all(seqs)

            def whole() -> dict[str, Any]:
                choices = [chat_choice(i, text, last.finish_reason or "stop", chat_logprobs(lps, engine.token_text) if wants_logprobs else None)
                           for i, (text, last, lps) in enumerate(answers)]
                return chat_response(rid, created, name, choices, use)

            return await _whole_answer(whole, off_loop=wants_logprobs)

        def frame(i: int, delta: Delta, is_first: bool) -> list[bytes]:
            out: list[bytes] = []
            if is_first:
                out.append(sse(chat_chunk(rid, created, name, {"role": "assistant", "content": ""}, None, with_usage_field=with_usage, index=i)))
            if delta.text or delta.logprobs:
                chunk = chat_chunk(rid, created, name, {"content": delta.text}, None, with_usage_field=with_usage, index=i)
                if wants_logprobs:
                    chunk["choices"][0]["logprobs"] = chat_logprobs(delta.logprobs, engine.token_text)
                out.append(sse(chunk))
            if delta.finish_reason is not None:
                out.append(sse(chat_chunk(rid, created, name, {}, delta.finish_reason, with_usage_field=with_usage, index=i)))
            return out

        def tail(prompt: int, completion: int) -> list[bytes]:
            if not with_usage:
                return []
            last = {**chat_chunk(rid, created, name, {}, None, with_usage_field=False), "choices": []}
            last["usage"] = usage(prompt, completion)
            return [sse(last)]

        return await _stream(request, seqs, frame, tail)
    finally:
        for seq in seqs:
            seq.cancel()  # a no-op when finished; frees the slot when the client went away


async def completions(request: web.Request) -> web.StreamResponse:
    """POST /v1/completions"""
    state = request.app[STATE]
    body = await _read_body(request, state.body_limit_bytes)
    req = await _parse(request, CompletionRequest, body)
    refusal = req.unsupported()
    if refusal is not None:
        raise refusal
    engine = _engine_for(state, req.model)
    ids = await _tokenize(request, encode_completion, engine, req, len(body))
    seqs = await _submit(state, engine, ids, req, "prompt")
    rid, created, name = _rid("cmpl"), int(time.time()), state.served_name
    wants_logprobs = req.logprob_count() is not None
    offsets = [TextOffsets() for _ in seqs]  # each choice's text position (no echo: its text starts at 0)
    try:
        if not req.stream:
            answers, use = await _collect_all(seqs)

            def whole() -> dict[str, Any]:
                choices = [completion_choice(i, text, last.finish_reason or "stop",
                                             completion_logprobs(lps, engine.token_text, TextOffsets()) if wants_logprobs else None)
                           for i, (text, last, lps) in enumerate(answers)]
                return completion_response(rid, created, name, choices, use)

            return await _whole_answer(whole, off_loop=wants_logprobs)

        def frame(i: int, delta: Delta, is_first: bool) -> list[bytes]:
            chunk = completion_chunk(rid, created, name, delta.text, delta.finish_reason, index=i)
            if wants_logprobs:
                chunk["choices"][0]["logprobs"] = completion_logprobs(delta.logprobs, engine.token_text, offsets[i])
            return [sse(chunk)]

        def tail(prompt: int, completion: int) -> list[bytes]:
            if not req.include_usage:
                return []
            return [sse({**completion_chunk(rid, created, name, "", None), "choices": [], "usage": usage(prompt, completion)})]

        return await _stream(request, seqs, frame, tail)
    finally:
        for seq in seqs:
            seq.cancel()


async def list_models(request: web.Request) -> web.Response:
    """GET /v1/models"""
    state = request.app[STATE]
    model = {"id": state.served_name, "object": "model", "created": state.created, "owned_by": "local"}
    return _json({"object": "list", "data": [model]})


async def healthz(request: web.Request) -> web.Response:
    """GET /healthz: 200 once the model is ready, 503 while loading (or after a failed load).

    Launched by a gateway (a health token set), each answer to a request with an X-Health-Nonce
    carries X-Health-Proof: HMAC-SHA256(token, nonce), hex, so the launcher knows this server for
    the one it started. Without a token (run by hand) or a nonce, no such header."""
    state = request.app[STATE]
    if state.engine is not None:
        response = _json({"status": "ok", "model": state.served_name})
    elif state.load_error is not None:
        response = _json({"status": "error", "error": state.load_error}, status=503)
    else:
        response = _json({"status": "loading"}, status=503)
    nonce = request.headers.get("X-Health-Nonce")
    if state.health_token and nonce and len(nonce) <= _NONCE_MAX_CHARS:
        response.headers["X-Health-Proof"] = hmac.new(state.health_token.encode(), nonce.encode("utf-8", "replace"), hashlib.sha256).hexdigest()
    return response


async def metrics(request: web.Request) -> web.Response:
    """GET /metrics: Prometheus text."""
    state = request.app[STATE]
    ready = 1 if state.engine is not None else 0
    text = f"# TYPE local_backend_ready gauge\nlocal_backend_ready {ready}\n"
    if state.engine is not None:
        text += state.engine.metrics_text(state.served_name)
    return web.Response(text=text, content_type="text/plain", charset="utf-8", headers={"X-Content-Type-Options": "nosniff"})


async def _tokenizer_thread(app: web.Application) -> AsyncIterator[None]:
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-backend-tokenize")
    app[TOKENIZER_THREAD] = pool
    yield
    pool.shutdown(wait=False, cancel_futures=True)


def create_app(state: BackendState) -> web.Application:
    """The application; run it with ``handler_cancellation=True`` so a vanished client frees its slot."""
    # aiohttp's own body cap sits above ours so our check answers first, in OpenAI's shape.
    app = web.Application(middlewares=[_errors], client_max_size=state.body_limit_bytes + 1)
    app[STATE] = state
    app.cleanup_ctx.append(_tokenizer_thread)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app
