"""Request validation: bad input is a 400 in OpenAI's shape that names the field."""

from __future__ import annotations

import orjson
import pytest

from local_backend.wire import ApiError, ChatRequest, CompletionRequest, parse_request


def _err(model: type, body: object) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse_request(model, body if isinstance(body, bytes) else orjson.dumps(body))
    return info.value


def test_valid_chat_request_parses() -> None:
    req = parse_request(ChatRequest, b'{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}],"stop":"x"}')
    assert req.messages[0].text() == "hi"
    assert req.stop_sequences() == ("x",)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 9}, "n"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a"] * 5}, "stop"),
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
    ],
)
def test_chat_errors_name_the_field(body: dict[str, object], param: str) -> None:
    err = _err(ChatRequest, body)
    assert err.status == 400 and err.param == param and err.type == "invalid_request_error"
    assert orjson.loads(err.body())["error"]["param"] == param


def test_completion_prompt_list_must_hold_one_prompt() -> None:
    assert _err(CompletionRequest, {"model": "m", "prompt": ["a", "b"]}).param == "prompt"


def test_not_json_and_not_an_object_are_400() -> None:
    assert _err(ChatRequest, b"{nope").status == 400
    assert _err(ChatRequest, b"[1, 2]").status == 400
