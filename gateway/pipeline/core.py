"""The request pipeline, top to bottom, in one place.

    early       a tenant out of requests (rpm): refused before parsing  (tenants/stage.py)
    intake      authenticate, parse, authorize, route, classify, band   (intake.py)
    pin         a follow-up goes where its state is                      (pinning.py)
    quota       the tenant's limits: reserved, then settled             (tenants/stage.py)
    cache       a hit, a flight's answer, or the relay's (then stored)   (cache/stage.py)
    admission   a place in the process's gate, or a fast refusal        (admission/stage.py)
    relay       failover, retries, hedging, streaming, rescue            (relay/core.py)
    observe     metrics, once, however it ended                          (observe/observer.py)

Each stage owns what it takes and gives it back on every way out (`async with`). `explain()`
runs the same stages without calling a backend, holding only one request of the tenant's limits
(the quota's verdict and the ranking are read, not taken).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..admission.gate import Ticket
from ..admission.stage import AdmissionStage, queue_view
from ..cache.stage import CacheStage
from ..config.runtime import Route, Runtime, answer_ceiling, answer_cost_usd
from ..errors import AllBackendsFailed, GatewayError, InternalError
from ..observe.observer import Observer
from ..relay.attempt import ClientGone
from ..relay.context import RelayContext
from ..relay.core import Relay, plan_view
from ..tenants.auth import Tenant
from ..tenants.stage import QuotaStage
from ..web.sink import Sink
from .call import CLIENT_CLOSED, Call, Finish
from .intake import intake, parse, verdict_view
from .pinning import Pinned, pin

__all__ = ["Pipeline", "parse"]

log = logging.getLogger("gateway.pipeline")


class Pipeline:
    """The stages, one set per process (each request brings its runtime snapshot)."""

    __slots__ = ("ctx", "observer", "quota", "cache", "admission")

    def __init__(self, ctx: RelayContext, observer: Observer) -> None:
        self.ctx, self.observer = ctx, observer
        self.quota = QuotaStage(ctx.metrics)
        self.cache = CacheStage(ctx)
        self.admission = AdmissionStage(ctx.admission, ctx.metrics)

    async def run(self, call: Call, rt: Runtime, sink: Sink) -> None:
        """Answer one request through every stage; always leaves an answer (data or error) in `sink`."""
        try:
            self.quota.early(rt, call, sink)  # a tenant out of requests: refused before parsing
            try:
                route, tenant = await intake(call, rt)
                # Before the quota: a follow-up's stored context is part of the prompt it reserves.
                pinned = await _pin(call, route, rt, tenant, learn=True)
            except GatewayError as err:
                await self.quota.refused(rt, call, err)  # counted in its rpm all the same
                raise
            route = route if pinned is None else pinned.route
            async with self.quota.hold(rt, call, route, tenant, sink):
                self._announce(call, sink)

                async def upstream(out: Sink) -> None:
                    relay = Relay(call, route, self.ctx, out)
                    try:
                        async with relay.heartbeat(), self.admission.slot(call, relay.pool, relay.ticket, out) as shed:
                            await relay.run(shed=shed)
                    except AllBackendsFailed as err:
                        raise err if pinned is None else pinned.failed(err) from None

                await self.cache.serve(rt, call, route, tenant, sink, produce=upstream)
        except ClientGone:
            _left(call, sink)
        except GatewayError as err:
            await _refuse(call, sink, err)
        except asyncio.CancelledError:
            _left(call, sink)  # aiohttp cancels the handler when the client goes away
            raise
        except Exception:  # a bug: still an answer in the contract, and the traceback in the log
            log.exception("request %s: internal error", call.request_id)
            await _refuse(call, sink, InternalError(f"internal error in the gateway (request id {call.request_id})"), bug=True)
        finally:
            if call.affinity is not None and call.affinity.unsized():
                self._size_context(call)
            self.observer.count(call, rt)

    def _size_context(self, call: Call) -> None:
        """An answer a follow-up can build on came without usage: its context is recorded as what
        the request was charged, in a task of its own (the handler may be cancelled: its client left)."""
        assert call.affinity is not None
        tokens = call.prompt_tokens + call.out.streamed_tokens
        if call.endpoint.answers_later(call.body):  # a background answer: what it may generate
            tokens += call.max_output_tokens() or 0
        task = asyncio.get_running_loop().create_task(call.affinity.size(tokens))
        carried = self.ctx.carried
        carried.add(task)
        task.add_done_callback(carried.discard)

    async def explain(self, call: Call, rt: Runtime) -> dict[str, Any]:
        """What the gateway would do with this request: the same stages, calling no backend and
        taking nothing but one request of the tenant's request limits (rpm, concurrency: it is
        parsed and classified like one), its lease given back before the quota's verdict; no
        tokens, no admission, no flight, no selector state. The verdict is the quota stage's for
        the same request sent next (read, not taken): a limit that would refuse it is its 429,
        and the answer limit that stage writes into the body is in the key the cache looks up
        (a real request's key is taken after it: explain said `miss` where it hit)."""
        async with self.quota.one_request(rt, call.tenant, call.remaining_s()):
            route, tenant = await intake(call, rt)
            pinned = await _pin(call, route, rt, tenant, learn=False)
        route = route if pinned is None else pinned.route
        if rt.quota is not None:
            await rt.quota.check(call, tenant, lambda: answer_ceiling(call, route),
                                 lambda p, c: answer_cost_usd(call, route, p, c))
        cache = await self.cache.explain(rt, call, route, tenant)
        ticket = call.ticket if call.ticket is not None else Ticket()
        plan, first = plan_view(call, route)
        return {
            **verdict_view(call, tenant),
            **cache,
            "band": ticket.band,
            "queue": queue_view(self.ctx.admission, ticket, first),
            # A follow-up: the backend that holds the state it builds on (its only candidate).
            "affinity": None if pinned is None else {"field": pinned.field, "id": pinned.ref, "backend": pinned.backend},
            **plan,
        }

    def _announce(self, call: Call, sink: Sink) -> None:
        if call.cls != "none":
            sink.set_header("x-gateway-class", call.cls)
            self.ctx.metrics.per_class[call.cls].inc()
            if call.verdict is not None:
                self.ctx.metrics.per_stage[call.verdict.stage].inc()


async def _pin(call: Call, route: Route, rt: Runtime, tenant: Tenant, *, learn: bool) -> Pinned | None:
    """An endpoint whose answers leave state on a backend: a follow-up goes to the backend holding
    what it builds on (pinning.py); `learn`: record the ids this answer makes its backend hold."""
    if not call.endpoint.stateful:
        return None
    if learn:
        call.affinity = rt.affinity.learner(tenant.cache_namespace)
    return await pin(call, route, rt, tenant.cache_namespace)


def _left(call: Call, sink: Sink) -> None:
    """The client went away: a client_disconnect, with status 499 (CLIENT_CLOSED) when it left
    before any answer went out (no stream's headers, no whole answer being written: the relay
    marks one `ok` before writing it); a stream cut after its 200 went out keeps its 200."""
    out = call.out
    if not sink.committed and out.finish is not Finish.OK and out.status == 200:
        out.status = CLIENT_CLOSED
    out.finish = Finish.CLIENT_DISCONNECT


async def _refuse(call: Call, sink: Sink, err: GatewayError, *, bug: bool = False) -> None:
    """Answer with `err` (a status, or an error event once streaming)."""
    call.out.status, call.out.error, call.out.finish = err.status, err.message, Finish.ERROR
    try:
        await sink.fail(err)
    except ConnectionError:  # reset, or lost while a write waited on a slow reader
        call.out.finish = Finish.CLIENT_DISCONNECT
    except Exception:
        if not bug:
            raise
        call.out.finish = Finish.CLIENT_DISCONNECT
