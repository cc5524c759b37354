"""The Responses API without sockets: the stream monitor, cache replay (parsed by the openai SDK),
the classifier's view of a Responses body, the error event, and the affinity map on both stores."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator

import orjson
import pytest
import redis.asyncio as aredis
from openai import omit
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from gateway.responses.affinity import Affinity, Holder, MapUnavailable, OwnerConflict, RecordFailed
from gateway.cache.entry import is_complete
from gateway.errors import BadRequest, UpstreamError
from gateway.responses.wire import ResponsesRequest, chat_view, error_event, held_ids, stateful_reason, stateful_refs, usage_of
from gateway.responses.replay import replay_events, replayable
from gateway.store.core import MemoryStore, Store, StoreError
from gateway.store.redis_store import RedisStore
from gateway.wire.openai_wire import SSEDecoder, event_data, parse_body
from tests.procs import redis_missing

REDIS_URL = "redis://127.0.0.1:6379/13"
TEXT = "The capital of France is Paris. " * 5


def _response(**over: object) -> dict:
    obj = {
        "id": "resp_1", "object": "response", "created_at": 1, "status": "completed", "model": "m",
        "output": [
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
             "content": [{"type": "output_text", "text": TEXT, "annotations": []}]},
            {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "lookup", "arguments": '{"city": "Paris"}',
             "status": "completed"},
        ],
        "parallel_tool_calls": True, "tool_choice": "auto", "tools": [],
        "usage": {"input_tokens": 12, "output_tokens": 30, "total_tokens": 42,
                  "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}},
    }
    obj.update(over)
    return obj


def _events(data: bytes) -> list[dict]:
    return [orjson.loads(event_data(e)) for e in SSEDecoder().feed(data)]


def test_a_replayed_hit_is_a_valid_event_sequence_the_sdk_assembles_into_the_same_response():
    stored = _response()
    data = replay_events(orjson.dumps(stored), chunk_chars=16)
    raw = SSEDecoder().feed(data)
    assert all(e.startswith(b"event: ") for e in raw)
    events = [orjson.loads(event_data(e)) for e in raw]
    kinds = [e["type"] for e in events]
    assert kinds[0] == "response.created" and kinds[1] == "response.in_progress" and kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert sum(k == "response.output_text.delta" for k in kinds) == -(-len(TEXT) // 16)
    # Every event is one of the SDK's types, and its own stream accumulator takes them in order.
    adapter = TypeAdapter(ResponseStreamEvent)
    state = ResponseStreamState(input_tools=omit, text_format=omit)
    for e in events:
        state.handle_event(adapter.validate_python(e))
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == TEXT
    assert "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta") == '{"city": "Paris"}'
    final = adapter.validate_python(events[-1])
    assert Response.model_validate(final.response.model_dump()).output_text == TEXT


def test_only_completed_responses_with_replayable_items_are_cached():
    assert replayable(_response()) and is_complete(_response())
    assert not replayable(_response(status="incomplete"))
    assert not replayable(_response(output=[{"type": "web_search_call", "id": "ws_1", "status": "completed"}]))
    assert not replayable(_response(output=[{"type": "message", "id": "m", "content": [{"type": "input_image"}]}]))
    assert not replayable({"object": "chat.completion"})


def test_the_classifier_reads_instructions_and_input_as_a_chat():
    view = chat_view({"instructions": "Be brief.", "input": "What is 2+2?", "max_output_tokens": 9})
    assert view == {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}], "max_tokens": 9}
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Write a sorting function."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "def f(): ..."}]},
        {"type": "function_call_output", "call_id": "c", "output": "42"},
    ]
    view = chat_view({"input": items, "tools": [{"type": "function", "name": "f"}]})
    assert [m["role"] for m in view["messages"]] == ["user", "assistant", "tool"]
    assert view["messages"][0]["content"] == [{"type": "text", "text": "Write a sorting function."}]
    assert view["tools"]


def test_stateful_requests_bypass_the_cache_and_name_what_they_build_on():
    assert stateful_refs({"previous_response_id": "resp_1"}) == [("previous_response_id", "resp_1")]
    assert stateful_refs({"conversation": {"id": "conv_1"}}) == [("conversation", "conv_1")]
    # Both at once: each is a reference to check (neither hides the other).
    assert stateful_refs({"previous_response_id": "resp_1", "conversation": "conv_1"}) == [
        ("previous_response_id", "resp_1"), ("conversation", "conv_1")]
    assert stateful_refs({"input": "hi"}) == []
    assert stateful_reason({"previous_response_id": "resp_1"}).startswith("previous_response_id")
    assert stateful_reason({"conversation": "conv_1"}).startswith("conversation")
    assert stateful_reason({"background": True}).startswith("background")
    assert stateful_reason({"top_logprobs": 2}) == "logprobs requested"
    assert stateful_reason({"input": "hi", "store": False}) is None
    assert held_ids({"id": "resp_1", "conversation": {"id": "conv_7"}}) == ["resp_1", "conv_7"]


def test_a_cut_stream_ends_with_an_error_event_the_sdk_raises_on():
    data = error_event(UpstreamError("the backend's connection was lost mid-stream"), 17)
    assert data.startswith(b"event: error\ndata: ")
    obj = orjson.loads(event_data(data))
    assert obj["type"] == "error" and obj["sequence_number"] == 17 and obj["code"] == "upstream_error"
    assert obj["error"]["message"] == obj["message"]  # the key on which the openai SDK raises APIError


# -- the affinity map, on both stores ------------------------------------------------------------


@contextlib.asynccontextmanager
async def _store(kind: str) -> AsyncIterator[Store]:
    if kind == "memory":
        yield MemoryStore()
        return
    prefix = f"test:affinity:{uuid.uuid4().hex}:"
    store = RedisStore(REDIS_URL, prefix=prefix, timeout_ms=500)
    try:
        await store.get("ping")
    except StoreError:
        redis_missing("no Redis at 127.0.0.1:6379")
    try:
        yield store
    finally:
        await store.close()
        raw = aredis.Redis.from_url(REDIS_URL)
        keys = [k async for k in raw.scan_iter(match=prefix + "*")]
        if keys:
            await raw.delete(*keys)
        await raw.aclose()


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_affinity_remembers_forgets_and_expires(kind: str):
    events: list[tuple[str, str]] = []
    async with _store(kind) as store:
        aff = Affinity(store, ttl_s=0.3, on_event=lambda op, r: events.append((op, r)))
        await aff.learner("tenant:a").learn({"id": "resp_x", "conversation": {"id": "conv_y"}}, "b1")
        assert await aff.lookup("resp_x") == Holder("b1", "tenant:a")
        assert await aff.lookup("conv_y") == Holder("b1", "tenant:a")
        assert await aff.lookup("resp_unknown") is None
        await aff.forget("conv_y")
        assert await aff.lookup("conv_y") is None
        assert await aff.lookup("x" * 1000) is None  # nobody's id
        await asyncio.sleep(0.45)
        assert await aff.lookup("resp_x") is None  # expired with its TTL
    assert ("learn", "ok") in events and ("lookup", "hit") in events and ("lookup", "miss") in events


class _Down(MemoryStore):
    """A store whose every call fails, counting the tries."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    async def get(self, key: str) -> bytes | None:
        self.calls += 1
        raise StoreError("down")

    async def set(self, key: str, value: bytes, ttl_s: float, *, replicas: int = 0) -> None:
        self.calls += 1
        raise StoreError("down")

    async def add(self, key: str, value: bytes, ttl_s: float, *, replicas: int = 0) -> bool:
        self.calls += 1
        raise StoreError("down")


async def test_affinity_fails_closed_when_its_store_fails():
    """Changed with issue 23 (it used to fail open: a lost record made the id anyone's)."""
    events: list[tuple[str, str]] = []
    store = _Down()
    aff = Affinity(store, ttl_s=60, on_event=lambda op, r: events.append((op, r)), timeout_s=0.05, attempts=3)
    with pytest.raises(RecordFailed) as exc:
        await aff.record(["resp_1"], "b1", "t")
    assert exc.value.status == 503 and exc.value.code == "response_record_failed" and "down" not in exc.value.message
    assert store.calls == 3  # every try, then the answer is refused
    await aff.record(["resp_2"], "b1", "t", required=False)  # nobody can follow it up: one try, reported only
    assert store.calls == 4
    with pytest.raises(MapUnavailable):
        await aff.lookup("resp_1")  # a store that cannot say is not "nobody has it"
    assert events == [("learn", "error"), ("learn", "error"), ("lookup", "error")]
    # store: false and no conversation: nothing can follow it, so its record is not required.
    await aff.learner("t").learn({"id": "resp_3", "store": False}, "b1")
    with pytest.raises(RecordFailed):
        await aff.learner("t").learn({"id": "resp_4", "store": False, "conversation": {"id": "conv_1"}}, "b1")


async def test_a_slow_record_write_gets_its_own_timeout_and_a_retry_that_finds_it_landed():
    class LandsThenHangs(MemoryStore):
        """The first add lands, then its answer never comes (a timeout after the write)."""

        hung = False

        async def add(self, key: str, value: bytes, ttl_s: float, *, replicas: int = 0) -> bool:
            stored = await super().add(key, value, ttl_s)
            if not self.hung:
                self.hung = True
                await asyncio.sleep(10)
            return stored

    store = LandsThenHangs()
    aff = Affinity(store, ttl_s=60, timeout_s=0.05, attempts=2)
    await aff.record(["resp_1"], "b1", "tenant:a")  # the retry finds the record is its own
    assert await aff.lookup("resp_1") == Holder("b1", "tenant:a")


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_a_record_is_never_overwritten_by_another_owner(kind: str):
    async with _store(kind) as store:
        aff = Affinity(store, ttl_s=60)
        await aff.learner("tenant:a").learn({"id": "resp_a", "conversation": {"id": "conv_a"}}, "b1")
        with pytest.raises(OwnerConflict) as exc:  # an answer naming a's conversation, for b
            await aff.learner("tenant:b").learn({"id": "resp_b", "conversation": {"id": "conv_a"}}, "b2")
        assert exc.value.status == 409
        assert await aff.lookup("conv_a") == Holder("b1", "tenant:a")
        # The owner's next turn refreshes its record (a conversation in use stays known).
        await aff.learner("tenant:a").learn({"id": "resp_a2", "conversation": {"id": "conv_a"}}, "b1")
        assert await aff.lookup("conv_a") == Holder("b1", "tenant:a")


async def test_only_the_migration_mode_adopts_the_previous_response():
    for adopt, expected in ((False, None), (True, Holder("b1", "tenant:a"))):
        aff = Affinity(MemoryStore(), ttl_s=60, adopt_unknown=adopt)
        await aff.learner("tenant:a").learn({"id": "resp_2", "previous_response_id": "resp_made_elsewhere"}, "b1")
        assert await aff.lookup("resp_made_elsewhere") == expected


@pytest.mark.parametrize("conversation", [{"id": 5}, {"id": ""}, {}, 5, "", ["conv_1"], True])
def test_a_conversation_must_be_an_id_or_an_object_with_one(conversation: object):
    with pytest.raises(BadRequest) as exc:
        parse_body(orjson.dumps({"model": "m", "input": "hi", "conversation": conversation}), ResponsesRequest)
    assert exc.value.param == "conversation"
    for good in ("conv_1", {"id": "conv_1"}, None):
        parse_body(orjson.dumps({"model": "m", "input": "hi", "conversation": good}), ResponsesRequest)


def test_a_replay_goes_on_in_whole_events_so_an_error_event_can_follow_the_last_one() -> None:
    """A replay's pieces split events anywhere: an error event written after a piece that ended
    inside an event was glued onto it, numbered from a cut sequence number (review of the change).
    Pieces go on as whole events; the sequence number is the last whole event's."""
    from gateway.responses.passthrough import _whole_events

    pieces = [b'event: a\ndata: {"sequence_number":3}\n\nevent: b\ndata: {"sequence_number":4', b',"delta":"he', b'"}\n\nevent: c']
    seq, partial, sent = -1, b"", b""
    seqs = []
    for p in pieces:
        whole, partial, seq = _whole_events(partial, p, seq)
        sent += whole
        seqs.append(seq)
    assert seqs == [3, 3, 4] and partial == b"event: c"
    assert sent.endswith(b"\n\n") and sent.count(b"\n\n") == 2
