"""A bug anywhere in the pipeline still answers in the contract: an OpenAI-shaped 500 before the
headers, an error event (and no [DONE]) after them, the request id in the message, and the right
status in the metrics. The bug is injected at the upstream seam: a pool whose responses raise."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from gateway.web.keys import RELAY
from gateway.upstream.client import UpstreamPool
from tests.conftest import simple_policy

MSG = [{"role": "user", "content": "hi"}]


class _BuggyResponse:
    """Delegates to a real response; raises a plain bug after `good` body reads."""

    def __init__(self, resp, good: int) -> None:
        self._resp, self._good = resp, good
        self.status = resp.status

    @property
    def headers(self):
        return self._resp.headers

    async def readany(self) -> bytes:
        if self._good <= 0:
            raise RuntimeError("a bug while reading")
        self._good -= 1
        return await self._resp.readany()

    async def read(self, max_bytes: int | None = None) -> bytes:
        raise RuntimeError("a bug while reading")

    def release(self) -> None:
        self._resp.close()

    def close(self) -> None:
        self._resp.close()


class _BuggyPool(UpstreamPool):
    def __init__(self, good: int) -> None:
        super().__init__()
        self.good = good

    async def post(self, *args, **kw):  # type: ignore[override]
        return _BuggyResponse(await super().post(*args, **kw), self.good)


async def _metrics(gw) -> str:
    async with aiohttp.ClientSession() as http:
        async with http.get(gw.url + "/metrics") as r:
            return await r.text()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream-before-first-byte"])
async def test_a_bug_before_the_answer_is_an_openai_shaped_500(upstream, gateway, stream):
    up = await upstream("a")
    gw = await gateway(simple_policy(up))
    gw.app[RELAY].pool = _BuggyPool(good=0)
    async with aiohttp.ClientSession() as http:
        body = {"model": "gpt-test", "messages": MSG, "stream": stream}
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers={"x-request-id": "req-bug-1"}) as r:
            assert r.status == 500 and r.content_type == "application/json"
            err = (await r.json())["error"]
            assert r.headers["x-request-id"] == "req-bug-1"
    assert err["type"] == "gateway_error" and "req-bug-1" in err["message"]
    assert 'code="500"' in await _metrics(gw)


async def test_a_bug_mid_stream_ends_in_an_error_event_without_done(upstream, gateway):
    up = await upstream("a", tokens=20, itl_ms=5)
    gw = await gateway(simple_policy(up))
    gw.app[RELAY].pool = _BuggyPool(good=2)
    async with aiohttp.ClientSession() as http:
        body = {"model": "gpt-test", "messages": MSG, "stream": True}
        async with http.post(gw.url + "/v1/chat/completions", json=body, headers={"x-request-id": "req-bug-2"}) as r:
            assert r.status == 200
            text = await r.read()
    events = [e for e in text.split(b"\n\n") if e.startswith(b"data: ")]
    last = orjson.loads(events[-1][6:])
    assert b"data: [DONE]" not in text
    assert last["error"]["type"] == "gateway_error" and "req-bug-2" in last["error"]["message"]
    assert 'code="500"' in await _metrics(gw)
