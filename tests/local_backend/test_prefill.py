"""A trailing assistant message is continued (an assistant prefill), as the gateway's continuation
of a broken stream expects from a backend with `prefill: true` (launched backends by default)."""

from __future__ import annotations

from local_backend.prompts import encode_chat
from local_backend.wire import ChatRequest


def _text(tiny, messages) -> str:
    ids = encode_chat(tiny.tokenizer, ChatRequest.model_validate({"model": "tiny-random", "messages": messages}))
    return tiny.tokenizer.decode(ids)


def test_a_trailing_assistant_message_is_continued_not_followed_by_a_new_turn(tiny):
    text = _text(tiny, [{"role": "user", "content": "count"}, {"role": "assistant", "content": "w0 w1 w2"}])
    assert text.endswith("<|im_start|>assistant\nw0 w1 w2")


def test_a_user_message_last_opens_the_assistants_turn(tiny):
    text = _text(tiny, [{"role": "user", "content": "count"}])
    assert text.endswith("<|im_start|>assistant\n")
