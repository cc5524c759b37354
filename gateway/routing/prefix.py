"""A prompt's prefix as a chain of block keys, the unit that prefix-cache affinity matches on.

No tokenizer: the prompt is read message by message (role, then content), and a long message is
cut into blocks of `block_chars` characters. Key i is a hash of everything up to the end of block
i (one running SHA-256, its digest taken at each block boundary), so two prompts share key i
exactly when they share their whole text up to there. A message's end always ends a block: a
conversation's next turn (the same messages plus new ones) then matches every key of the turn
before it, however short its messages.

Every worker and replica computes the same keys for the same prompt (no per-process hash seed),
which is what lets them agree on a prefix's home without talking to each other.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import orjson

__all__ = ["MAX_BLOCKS", "prefix_keys"]

MAX_BLOCKS = 128  # keys past this are not computed: a very long prompt costs at most this many blocks
_SEP = b"\x1e"  # between a role and its content, and after each message: "ab"+"c" differs from "a"+"bc"


def prefix_keys(view: Mapping[str, Any], block_chars: int, namespace: str = "") -> tuple[bytes, ...]:
    """The chained block keys of a chat-shaped body (`messages`, or a text `prompt`); () when
    it has no prompt to read. `namespace` (the tenant's cache namespace) seeds the chain: one
    tenant's prompts never match another's, so no answer header or explain can tell a caller
    what someone else has sent."""
    messages = view.get("messages")
    if isinstance(messages, list):
        parts = [(m.get("role"), m.get("content")) for m in messages if isinstance(m, dict)]
    else:
        prompt = view.get("prompt")
        if not isinstance(prompt, str):
            return ()
        parts = [("prompt", prompt)]
    h = hashlib.sha256()  # SHA extensions on current x86 and ARM: the fastest hashlib digest here
    update, digest = h.update, h.digest
    update(namespace.encode() + _SEP)
    keys: list[bytes] = []
    for role, content in parts:
        if type(content) is str:
            text = content.encode()
        elif content is None:
            text = b""
        else:  # content parts, tool calls: their JSON is the text the backend caches too
            text = orjson.dumps(content)
        head = (role if type(role) is str else str(role)).encode() + _SEP
        n = len(text)
        if n <= block_chars:  # most messages: one block
            update(head + text + _SEP)
            keys.append(digest()[:16])
        else:
            update(head)
            view_ = memoryview(text)
            for start in range(0, n, block_chars):
                update(view_[start : start + block_chars])
                if start + block_chars >= n:
                    update(_SEP)
                keys.append(digest()[:16])
                if len(keys) >= MAX_BLOCKS:
                    break
        if len(keys) >= MAX_BLOCKS:
            return tuple(keys[:MAX_BLOCKS])
    return tuple(keys)
