"""Anthropic's Messages API: its wire format (wire.py) and the translation to and from OpenAI chat
completions, for whole bodies (translate.py) and for streams (stream.py). Pure: no I/O.

Used two ways: a Messages client (`POST /v1/messages`) answered by an OpenAI backend, and an
OpenAI client answered by an Anthropic backend (`kind: anthropic`). A native pairing passes
bodies through untranslated.
"""

from __future__ import annotations

from .stream import DONE, ChatToMessagesStream, MessagesToChatStream, StreamOrderError, UpstreamStreamError
from .translate import (
    BadAnswer,
    TranslationError,
    Untranslatable,
    chat_completion_to_message,
    chat_to_messages,
    message_id,
    message_to_chat_completion,
    messages_to_chat,
)
from .wire import MessagesRequest, error_body, error_event, error_type, gateway_error, parse_messages

__all__ = [
    "DONE",
    "BadAnswer",
    "ChatToMessagesStream",
    "MessagesRequest",
    "MessagesToChatStream",
    "StreamOrderError",
    "TranslationError",
    "UpstreamStreamError",
    "Untranslatable",
    "chat_completion_to_message",
    "chat_to_messages",
    "error_body",
    "error_event",
    "error_type",
    "gateway_error",
    "message_id",
    "message_to_chat_completion",
    "messages_to_chat",
    "parse_messages",
]
