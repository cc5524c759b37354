"""The stream monitors (wire/monitor.py) fed scripted events, without sockets: what each event of a chat
or Responses stream means to the pump, and what the monitor keeps for afterwards."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.cache.entry import is_complete
from gateway.wire.chat import CHAT, COMPLETIONS
from gateway.relay.continuation import Mismatch, Resume, Transcript
from gateway.wire.monitor import Verdict
from gateway.wire.chat_monitor import ChatMonitor
from gateway.responses.codec import RESPONSES
from gateway.responses.monitor import ResponsesMonitor
from gateway.wire.openai_wire import SSE_DONE

NOISE, DROP, MALFORMED, HELD, CONTENT, DONE, FAILED = (
    Verdict.NOISE, Verdict.DROP, Verdict.MALFORMED, Verdict.HELD, Verdict.CONTENT, Verdict.DONE, Verdict.FAILED,
)


def _chunk(delta: dict[str, Any] | None = None, finish: str | None = None, **extra: Any) -> bytes:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return orjson.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": choices, **extra})


def _feed(mon: Any, events: list[bytes]) -> list[Verdict]:
    return [mon.feed(e) for e in events]


USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def test_a_chat_stream_is_held_until_its_first_token_then_content_until_done():
    mon = ChatMonitor()
    verdicts = _feed(mon, [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Hel"}), _chunk({"content": "lo"}),
                           _chunk({}, "stop"), b"[DONE]"])
    assert verdicts == [HELD, CONTENT, CONTENT, HELD, DONE]
    assert mon.finished and mon.failure is None and mon.ending == SSE_DONE


def test_a_chat_chunk_finishes_the_answer_with_its_last_token():
    mon = ChatMonitor()
    assert mon.feed(_chunk({"content": "bye"}, "length")) is CONTENT and mon.finished


def _choice(i: int, text: str | None, finish: str | None = None) -> bytes:
    delta = {} if text is None else {"content": text}
    return orjson.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                         "choices": [{"index": i, "delta": delta, "finish_reason": finish}]})


def test_an_answer_of_several_choices_is_finished_once_each_choice_seen_is():
    # n = 2: choice 0's stop while choice 1 was mid-answer made a stream cut there end with [DONE]
    # (review helper's repro); a chunk after a choice's finish (usage, an empty delta) reopens nothing.
    mon = ChatMonitor()
    _feed(mon, [_choice(0, "a"), _choice(1, "b"), _choice(0, None, "stop")])
    assert not mon.finished
    _feed(mon, [_choice(1, "c"), _choice(1, None, "length"), _choice(0, None)])
    assert mon.finished
    one = ChatMonitor()  # a backend that ignores n answers one choice: finished at its stop
    _feed(one, [_choice(0, "a"), _choice(0, None, "stop")])
    assert one.finished


@pytest.mark.parametrize("delta", [{"tool_calls": [{"index": 0, "id": "t"}]}, {"function_call": {"name": "f"}}, {"refusal": "no"}])
def test_tool_calls_function_calls_and_refusals_are_output(delta):
    mon = ChatMonitor()
    assert mon.feed(_chunk(delta)) is CONTENT and mon.timed


def test_completions_text_is_output():
    mon = ChatMonitor()
    assert mon.feed(orjson.dumps({"choices": [{"index": 0, "text": "hi", "finish_reason": None}]})) is CONTENT


def test_malformed_chunks_are_told_apart_and_dropped():
    mon = ChatMonitor()
    assert _feed(mon, [b"{not json", b"[1, 2]", b'"text"']) == [MALFORMED, MALFORMED, MALFORMED]
    assert mon.feed(_chunk({"content": "ok"})) is CONTENT


@pytest.mark.parametrize("err,words", [({"message": "overloaded"}, "overloaded"), ("plain words", "plain words")])
def test_an_error_event_is_the_backends_failure_in_its_words(err, words):
    mon = ChatMonitor()
    assert mon.feed(orjson.dumps({"error": err})) is FAILED
    assert mon.failure == words and not mon.relays_failure


def test_the_usage_chunk_the_gateway_asked_for_is_dropped_but_kept():
    mon = ChatMonitor(strip_usage=True)
    assert _feed(mon, [_chunk({"content": "a"}, "stop"), _chunk(None, usage=USAGE)]) == [CONTENT, DROP]
    assert mon.usage == USAGE
    asked = ChatMonitor()
    assert asked.feed(_chunk(None, usage=USAGE)) is HELD and asked.usage == USAGE  # the client asked for it


def test_a_captured_stream_becomes_the_cache_entry_of_its_whole_answer():
    mon = ChatMonitor(capture=1 << 20)
    _feed(mon, [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Hi"}), _chunk({}, "stop"),
                _chunk(None, usage=USAGE), b"[DONE]"])
    entry = mon.entry()
    assert entry is not None and is_complete(entry.answer())
    assert entry.answer()["choices"][0]["message"]["content"] == "Hi" and entry.usage() == USAGE
    unfinished = ChatMonitor(capture=1 << 20)
    unfinished.feed(_chunk({"content": "Hi"}))
    assert unfinished.entry() is None and ChatMonitor().entry() is None


def test_a_continuation_rewrites_each_event_through_its_hook():
    t = Transcript()
    t.note(orjson.loads(_chunk({"content": "Hel"})), "p")
    resume = Resume(t, "restart", "s", "cut")
    mon = CHAT.monitor(capture=0, strip_usage=False, rewrite=resume.rewrite)
    # The restarted answer repeats what the client has: timed (the backend's output), but dropped.
    assert mon.feed(orjson.dumps({"id": "x", "choices": [{"index": 0, "delta": {"content": "Hel"}}]})) is DROP
    assert mon.timed
    assert mon.feed(orjson.dumps({"id": "x", "choices": [{"index": 0, "delta": {"content": "lo"}}]})) is CONTENT
    assert mon.out is not None and orjson.loads(mon.out.removeprefix(b"data: "))["id"] == "c1"  # the first stream's id
    assert mon.event is not None and mon.event["choices"][0]["delta"]["content"] == "lo"
    with pytest.raises(Mismatch):
        CHAT.monitor(capture=0, strip_usage=False, rewrite=Resume(t, "restart", "s", "cut").rewrite).feed(
            orjson.dumps({"choices": [{"index": 0, "delta": {"content": "Bye"}}]}))


def test_a_prefill_asks_the_backend_to_go_on_from_the_delivered_text():
    assert CHAT.prefill({"messages": [{"role": "user", "content": "q"}]}, "Hel")["messages"][-1] == {
        "role": "assistant", "content": "Hel"}
    assert COMPLETIONS.prefill({"prompt": "Tell: "}, "Once")["prompt"] == "Tell: Once"


def _event(kind: str, **fields: Any) -> bytes:
    return orjson.dumps({"type": kind, **fields})


def _response(**over: Any) -> dict[str, Any]:
    return {"id": "resp_1", "object": "response", "status": "completed", "model": "m",
            "output": [{"type": "message", "id": "msg_1", "role": "assistant",
                        "content": [{"type": "output_text", "text": "Hi", "annotations": []}]}],
            "usage": {"input_tokens": 12, "output_tokens": 30, "total_tokens": 42}, **over}


def test_the_responses_monitor_tells_deltas_ends_and_failures_apart():
    mon = ResponsesMonitor()
    assert mon.feed(_event("response.created", response={"id": "resp_9"})) is HELD
    assert mon.created == mon.record == {"id": "resp_9"}  # recorded before anything is released
    assert mon.feed(_event("response.output_item.added", item={})) is HELD and mon.record is None
    # A stored response's item, recorded before its event is released (a later item_reference names it)
    assert mon.feed(_event("response.output_item.added", item={"id": "msg_1"})) is HELD and mon.record == {"output": [{"id": "msg_1"}]}
    assert mon.feed(_event("response.output_text.delta", delta="a")) is CONTENT and mon.timed
    assert mon.feed(_event("response.function_call_arguments.delta", delta="{")) is CONTENT
    assert not mon.finished
    assert mon.feed(_event("response.completed", response=_response())) is HELD and mon.finished
    assert mon.usage == {"prompt_tokens": 12, "completion_tokens": 30, "total_tokens": 42}
    assert mon.feed(orjson.dumps({"no": "type"})) is DROP
    assert mon.feed(b"[DONE]") is NOISE  # some servers add one: not part of the answer
    assert mon.feed(b"{oops") is MALFORMED


@pytest.mark.parametrize("event,words", [
    ({"type": "response.failed", "response": {"error": {"message": "overloaded"}}}, "overloaded"),
    ({"type": "error", "code": "server_error", "message": "boom", "sequence_number": 3}, "boom"),
    ({"error": {"message": "chat-style"}}, "chat-style"),
])
def test_a_responses_failure_is_passed_on_in_the_backends_words(event, words):
    mon = ResponsesMonitor()
    assert mon.feed(orjson.dumps(event)) is FAILED
    assert mon.failure == words and mon.relays_failure


def test_a_completed_replayable_response_is_the_cache_entry():
    mon = RESPONSES.monitor(capture=1 << 20, strip_usage=False, rewrite=None)
    mon.feed(_event("response.completed", response=_response()))
    entry = mon.entry()
    assert entry is not None and orjson.loads(entry.body)["id"] == "resp_1"
    small = ResponsesMonitor(capture=10)
    small.feed(_event("response.completed", response=_response()))
    assert small.entry() is None  # over the capture
    odd = ResponsesMonitor(capture=1 << 20)
    odd.feed(_event("response.completed", response=_response(status="incomplete")))
    assert odd.entry() is None


def test_a_chat_stream_without_the_usage_its_client_asked_for_gets_the_estimate_once_finished():
    events = [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Hi"}), _chunk({}, "stop")]
    mon = ChatMonitor(client_usage=True)
    _feed(mon, events[:2])
    assert mon.estimated_usage(7, 1) == b""  # not finished: the relay cuts it, no usage to make up
    _feed(mon, events[2:])
    ev = mon.estimated_usage(7, 1)
    assert orjson.loads(ev.removeprefix(b"data: ")) == {
        "id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [],
        "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8},
    }
    assert ev.endswith(b"\n\n")
    # The backend's own usage; a client that did not ask (the gateway did, for its quota): none made up.
    sent = ChatMonitor(client_usage=True)
    _feed(sent, [*events, _chunk(None, usage=USAGE)])
    assert sent.estimated_usage(7, 1) == b"" and sent.usage == USAGE
    for mon in (ChatMonitor(), ChatMonitor(client_usage=True, strip_usage=True)):
        _feed(mon, events)
        assert mon.estimated_usage(7, 1) == b""


def test_the_chat_endpoint_monitor_knows_whether_the_client_asked_for_usage():
    asked = {"stream": True, "stream_options": {"include_usage": True}}
    for body, want in ((asked, True), ({"stream": True}, False), ({"stream": True, "stream_options": {"include_usage": "yes"}}, False)):
        mon = CHAT.monitor(capture=0, strip_usage=False, rewrite=None, body=body)
        _feed(mon, [_chunk({"content": "Hi"}, "stop")])
        assert bool(mon.estimated_usage(1, 1)) is want, body
