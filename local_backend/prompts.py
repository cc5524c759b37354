"""Turn OpenAI request bodies into prompt token ids (chat template or raw prompt)."""

from __future__ import annotations

from typing import Any

from .wire import ApiError, ChatRequest, CompletionRequest

__all__ = ["encode_chat", "encode_completion"]


def encode_chat(tokenizer: Any, request: ChatRequest) -> list[int]:
    """Render the messages with the model's chat template, ending with the assistant's turn (a
    trailing assistant message is that turn's beginning, continued: a prefill)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ApiError(400, "this model has no chat template: use /v1/completions", param="messages")
    # The SmolLM2 template knows system/user/assistant; OpenAI's newer "developer" role is a system prompt.
    messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in request.messages]
    if messages and messages[-1]["role"] == "assistant":
        # An assistant prefill: continue that message (how the gateway continues an answer that
        # broke on another backend), rather than start a new turn after it.
        text = tokenizer.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    else:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids: list[int] = tokenizer(text, add_special_tokens=False).input_ids
    return ids


def encode_completion(tokenizer: Any, request: CompletionRequest) -> list[int]:
    """Tokenize a raw prompt (a string, a one-string list, or token ids)."""
    prompt = request.prompt
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt[0], str):
        text = str(prompt[0])
    else:
        vocab = len(tokenizer)
        token_ids = [int(t) for t in prompt]
        if any(t < 0 or t >= vocab for t in token_ids):
            raise ApiError(400, f"prompt: token ids must lie in [0, {vocab})", param="prompt")
        return token_ids
    if not text:
        raise ApiError(400, "prompt: must not be empty", param="prompt")
    ids: list[int] = tokenizer(text).input_ids
    return ids
