"""SSE framing and body parsing, fed bytes directly (no sockets)."""

from __future__ import annotations

import pytest

from gateway.errors import BadRequest
from gateway.wire.openai_wire import ChatRequest, SSEDecoder, event_data, parse_body


def test_events_split_across_reads_come_out_whole_and_byte_exact():
    d = SSEDecoder()
    stream = b'data: {"a":1}\n\ndata: {"b":2}\n\n: ping\n\ndata: [DONE]\n\n'
    out = []
    for i in range(0, len(stream), 3):
        out.extend(d.feed(stream[i : i + 3]))
    assert out == [b'data: {"a":1}\n\n', b'data: {"b":2}\n\n', b": ping\n\n", b"data: [DONE]\n\n"]
    assert d.pending == b""


def test_crlf_streams_are_understood():
    d = SSEDecoder()
    assert d.feed(b'data: {"a":1}\r\n\r\ndata: x') == [b'data: {"a":1}\n\n']
    assert d.pending == b"data: x"


def test_event_data_handles_comments_and_multiline_data():
    assert event_data(b'data: {"a":1}\n\n') == b'{"a":1}'
    assert event_data(b": keep-alive\n\n") is None
    assert event_data(b"event: message\ndata: {\"a\":\ndata: 1}\n\n") == b'{"a":\n1}'
    assert event_data(b"data:[DONE]\n\n") == b"[DONE]"


def test_parse_body_names_nested_fields():
    with pytest.raises(BadRequest) as exc:
        parse_body(b'{"model":"m","messages":[{"role":"user"},{"role":"x"}]}', ChatRequest)
    assert exc.value.param == "messages[1].role"


def test_parse_body_keeps_unknown_fields():
    typed, raw = parse_body(b'{"model":"m","messages":[{"role":"user","content":"hi"}],"x_vendor":1}', ChatRequest)
    assert typed.model == "m" and raw["x_vendor"] == 1


def test_content_parts_are_accepted():
    body = b'{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}'
    typed, _ = parse_body(body, ChatRequest)
    assert typed.messages[0].content == [{"type": "text", "text": "hi"}]
