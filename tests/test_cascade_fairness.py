"""Fairness of the classifier encoder's queue between tenants (gateway/classify/cascade.py): a
tenant that keeps many uncertain requests waiting must not send every other tenant's uncertain
requests to the deadline stage (the big model), whatever its share of the queue."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")  # the `local` extra: `make test` installs it

from gateway.classify.cascade import EncoderWorker, _Job, _Turns  # noqa: E402
from gateway.classify.encoder import Encoder  # noqa: E402
from gateway.config.policy import EncoderPolicy  # noqa: E402
from tests.test_classify_encoder import _learn_cost, _PerText, _ready, _swap, tiny_folder  # noqa: E402

_PER_TEXT_S = 0.005  # what the scorer costs a text: a batch of 8 takes 40 ms, as on a CPU
_DEADLINE_S = 0.1
_RUN_S = 1.2


async def _one_at_a_time(w: EncoderWorker, tenant: str, share: int | None, until: float) -> tuple[int, int]:
    """A tenant sending one uncertain request at a time (a short pause between): (scored, sent)."""
    scored = sent = 0
    while time.monotonic() < until:
        sent += 1
        scored += await w.score(f"{tenant}'s question {sent}", _DEADLINE_S, tenant, share) is not None
        await asyncio.sleep(0.01)
    return scored, sent


async def _flooder(w: EncoderWorker, share: int | None, stop: asyncio.Event, i: int) -> None:
    """One of the flooding tenant's callers: a new uncertain request as soon as the last ends."""
    n = 0
    while not stop.is_set():
        n += 1
        if await w.score(f"flood {i} {n}", _DEADLINE_S, "mallory", share) is None:
            await asyncio.sleep(0.002)  # refused at once (its share waits): tries again soon


@pytest.mark.parametrize("share", [4, 24])  # the default (half of max_batch), and one past max_batch
async def test_a_flooding_tenant_does_not_starve_another_ones_uncertain_requests(tmp_path: Path, share: int) -> None:
    """Mallory keeps 20 uncertain requests in flight (as many waiting as its share lets it);
    alice sends one at a time. Alice's requests are scored about as often as when she is alone,
    not told `late` behind mallory's queue (first come, first served would put her behind up to
    `share` of mallory's requests, two or more batches with a share past max_batch)."""
    folder = tiny_folder(tmp_path)
    w = await _ready(EncoderPolicy(weights_dir=str(folder), max_batch=8))
    _swap(w, _PerText(Encoder.load(folder), _PER_TEXT_S))
    try:
        await _learn_cost(w)
        alone, alone_sent = await _one_at_a_time(w, "alice", share, time.monotonic() + _RUN_S)
        stop = asyncio.Event()
        flood = [asyncio.create_task(_flooder(w, share, stop, i)) for i in range(share + 8)]
        await asyncio.sleep(0.1)  # mallory's queue fills
        busy, busy_sent = await _one_at_a_time(w, "alice", share, time.monotonic() + _RUN_S)
        stop.set()
        await asyncio.gather(*flood)
        print(f"share {share}: alice alone {alone}/{alone_sent} scored, beside mallory's flood {busy}/{busy_sent}")
        # Not starved: scored about as often as alone. First come, first served, with a share of
        # 24 (16-24 of mallory's waiting), scored 4 of 77; taking turns, 39 of 39.
        assert alone > 0 and busy / busy_sent >= 0.7 * alone / alone_sent, (busy, busy_sent, alone, alone_sent)
        assert w._waiting_of == {}
    finally:
        w.close()


def _job(tenant: str, n: int) -> _Job:
    return _Job(f"{tenant} {n}", None, None, 0.0, 10, tenant)  # type: ignore[arg-type]


def test_turns_are_first_come_first_served_for_one_tenant_and_round_robin_for_several() -> None:
    one = _Turns()
    for n in range(4):
        one.add(_job("", n))
    assert [one.pop().text for _ in range(4)] == [" 0", " 1", " 2", " 3"] and not one
    two = _Turns()
    for n in range(4):
        two.add(_job("mallory", n))
    two.add(_job("alice", 0))
    assert two.first().text == "mallory 0"
    got = [two.pop().text for _ in range(2)]
    two.add(_job("alice", 1))  # alice's next comes after mallory's next: one each per round
    got += [two.pop().text for _ in range(len(two))]
    assert got == ["mallory 0", "alice 0", "mallory 1", "alice 1", "mallory 2", "mallory 3"]


def test_a_request_is_told_late_by_what_is_ahead_of_it_in_turn() -> None:
    """24 of mallory's requests queued, three batches at 40 ms each: a request that waits behind
    all of them (one caller, or mallory's own) is late for 100 ms; alice's, in turn after one of
    mallory's, is not."""
    w = EncoderWorker(EncoderPolicy(max_batch=8))
    for _ in range(8):
        w._cost.observe(80, 0.04)  # 8 texts of 10 units: 40 ms
    w._put_jobs, w._put_units, w._waiting_of = 24, 240, {"mallory": 24}
    now = time.monotonic()
    assert w._late(now, 10, _DEADLINE_S)  # first come, first served
    assert w._late(now, 10, _DEADLINE_S, "mallory", 24)
    assert not w._late(now, 10, _DEADLINE_S, "alice", 0)
    w._waiting_of["bob"] = 1
    assert not w._late(now, 10, _DEADLINE_S, "alice", 0)  # one of mallory's, bob's, then alice's
