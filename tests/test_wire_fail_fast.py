"""A body of a huge list of bad elements is refused at its first bad element: pydantic validated
and listed every one of them on the event loop (400,000 bad content parts: 400,001 errors, ~1.4 s
of the gateway's loop; 300,000 in the local backend's: 2.5 s, its health checks failed and the
gateway restarted it). Counted here as the errors a refusal builds, not as time."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, ValidationError

import local_backend.wire as local
from gateway.wire.endpoints import ENDPOINTS

N = 200_000

CASES: list[tuple[type[BaseModel], dict[str, Any]]] = [
    (ENDPOINTS["chat"].request, {"model": "m", "messages": [{"role": "user", "content": [1] * N}]}),
    (ENDPOINTS["chat"].request, {"model": "m", "messages": [{"role": "robot"}] * N}),
    (ENDPOINTS["completions"].request, {"model": "m", "prompt": [[1]] * N + [1.5]}),
    (ENDPOINTS["completions"].request, {"model": "m", "prompt": [1.5] * N}),
    (ENDPOINTS["embeddings"].request, {"model": "m", "input": [None] * N}),
    (ENDPOINTS["responses"].request, {"model": "m", "input": [1] * N}),
    (ENDPOINTS["messages"].request, {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": [{}] * N}]}),
    (ENDPOINTS["messages"].request, {"model": "m", "max_tokens": 8, "messages": [{"role": "robot", "content": "x"}] * N}),
    (ENDPOINTS["messages"].request, {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}],
                                     "stop_sequences": [1] * N}),
    (local.ChatRequest, {"model": "m", "messages": [{"role": "user", "content": [{}] * N}]}),
    (local.ChatRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": [1] * N}),
    (local.CompletionRequest, {"model": "m", "prompt": [1.5] * N}),
]


@pytest.mark.parametrize(("model", "body"), CASES, ids=[f"{m.__module__.split('.')[0]}-{i}" for i, (m, _) in enumerate(CASES)])
def test_a_huge_list_of_bad_elements_is_refused_at_its_first(model, body):
    with pytest.raises(ValidationError) as exc:
        model.model_validate(body)
    assert exc.value.error_count() <= 10, exc.value.error_count()
