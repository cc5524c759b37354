"""Health of one backend: passive ejection with growing back-off, half-open trials, cool-downs.

The relay reports outcomes (and the prober reports probe results); this object decides. States:

- ``starting``: a launched backend is not ready yet (`ready` is False); when its launch failed,
  `start_failure` says why and `start_retry_at` when the launcher tries again;
- ``ejected``: `failures_to_eject` consecutive failures (errors or timeouts) took it out for a
  back-off of ``eject_s * 2**(n-1)`` (n: ejections in a row without a success), capped at
  `max_eject_s`, shortened by up to `jitter` at random so replicas do not all retry at once;
- ``probing`` (half-open): the back-off ran out, or a probe succeeded, but no request has succeeded
  since; the next outcome decides: a success makes it ``healthy``, one failure ejects it again for
  a longer back-off (one tenant's, in a trial a probe let through: once a probe agrees, below).
  The selector gives a probing backend one request at a time (and the relay never retries it once
  it is ejected again: a trial costs one attempt);
- ``cooling``: an upstream 429/503 asked for a pause (Retry-After); it is busy, not broken;
- ``healthy``.

What ends an ejection early: a good *request* probe (a one-token request to the model itself,
probes.py) ends any ejection, so a recovery is seen within a probe interval whatever the back-off
says; the back-off then only bounds how often a user request is the trial while the backend stays
down. Two exceptions keep a half-working backend from costing a user request every probe interval:
once a trial that a good request probe let through has failed (the backend answers a one-token
probe while its real requests fail), its request probes end nothing until a real request succeeds;
and a good *model-list* probe, which is no evidence that completions work, ends only a first
ejection.

One tenant cannot eject a backend for the others (`corroborate`): an ejection by a run of
failures a request can cause (`Outcome.asked`: a 500 on what a caller sent, a timeout) that one tenant's
requests alone met is `verifying`: the request prober probes it at once, and an answer undoes it
and forgives that tenant's failures for `max_eject_s`; a failure confirms it. So is the failure
of a half-open trial that a good request probe let through, when one tenant's request failed it
(`suspect_trial`): a trial is one request, so the tenant whose requests a backend fails (a poison
prompt) took every trial and kept a healthy backend out for everyone while it kept sending (review
helper's repro); an answer puts it back to half-open (another tenant's failed trial then
corroborates the first and ejects at once), a failure confirms it. A trial the back-off let
through re-ejects at once as before (no probe vouched for the backend): its probes still end
that ejection, and the next trial is then one a probe let through. So is one by
timeouts at a deadline the relay set from live data (`LIVE_DEADLINE`, shorter than the backend's
`first_token_ms`: 2x the live P95, which other requests set), whoever's requests met them: a flood
of fast requests can shrink that deadline under ordinary slow ones (review helper's repro), and a
hung backend fails the probe.

"Never eject the last healthy backend" needs a view of all candidates: see `routing.usable()`.

Health is kept per (backend, upstream model): a provider's 429 or 500 on one model says nothing
about its other models. Each model's Health has the backend's own as its `parent`, which holds
what is about the backend as a whole (readiness, probes, refused connections); a model is usable
only while both are.

What counts against a backend's health, and what teaches its latency tracker, is decided in one
place: `OUTCOMES` below (the relay looks each attempt's outcome up there, and the tests check
every row).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = ["LIVE_DEADLINE", "Health", "Kind", "Outcome", "OUTCOMES", "outcome"]

# Who a timeout at a live deadline is blamed on (`Health.report_failure`): no tenant's name (a
# tenant's starts with a letter or a digit).
LIVE_DEADLINE = "<live deadline>"


class Kind(StrEnum):
    """How one attempt ended: the keys of OUTCOMES. An upstream HTTP status becomes a kind with
    `Kind.http(status)` (every 5xx but 503 is HTTP_5XX); its metric label keeps the status (`label`)."""

    OK = "ok"
    CONNECT = "connect"  # refused, reset, TLS failure
    RESET_BEFORE_HEADERS = "reset_before_headers"  # the request left; no answer came
    TIMEOUT = "timeout"  # the backend's own deadline (headers or whole answer)
    FIRST_TOKEN_TIMEOUT = "first_token_timeout"  # the backend's own first-token deadline
    HTTP_5XX = "http_5xx"
    HTTP_503 = "http_503"  # also cools down for its Retry-After
    HTTP_429 = "http_429"  # busy, not broken: a cool-down, not an ejection
    HTTP_401 = "http_401"  # our key is wrong for it: unusable for us
    HTTP_403 = "http_403"
    HTTP_408 = "http_408"
    HTTP_404 = "http_404"  # the path or model is not served there
    HTTP_405 = "http_405"
    MALFORMED = "malformed"  # 200 with a body that is no answer
    TOO_LARGE = "too_large"  # past a cap on what we read from a backend
    ERROR_EVENT = "error_event"  # an error event before the first token
    CUT = "cut"  # the stream ended before its first token
    DISCONNECT = "disconnect"  # the connection died before the first token
    CUT_MID_STREAM = "cut_mid_stream"
    ERROR_EVENT_MID_STREAM = "error_event_mid_stream"
    REJECTED = "rejected"  # a 4xx about the request itself
    CALLER_DEADLINE = "caller_deadline"  # the caller's own timeout
    CLIENT_DISCONNECT = "client_disconnect"
    LOST = "lost"  # a hedged rival answered first
    MISMATCH = "mismatch"  # a restarted continuation whose answer began differently
    CONTEXT_LENGTH = "context_length"  # the prompt does not fit its window
    KEY_REVOKED = "key_revoked"  # the caller's virtual key stopped working meanwhile

    @classmethod
    def http(cls, status: int) -> Kind:
        """The kind of a failing upstream status (every 5xx but 503 and 529 is HTTP_5XX)."""
        if status == 529:  # Anthropic's overloaded_error: busy, as a 503
            return cls.HTTP_503
        if status >= 500 and status != 503:
            return cls.HTTP_5XX
        return cls(f"http_{status}")

    def label(self, status: int | None = None) -> str:
        """The metric label and log word: the kind, with a 5xx's own status (`http_502`)."""
        return f"http_{status}" if self is Kind.HTTP_5XX and status is not None else self.value


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one attempt's ending is accounted. `health`: counts as a failure of the backend (a run
    of them ejects it). `sample`: the attempt is a latency/error sample for the tracker (a timeout
    sample raises the TTFT estimate). `failover`: the next candidate may take over. `asked`: what
    the request held may have caused it (a 500 on one caller's input): a run of such failures that
    one tenant alone met needs a probe's corroboration to eject (Health.corroborate)."""

    health: bool
    sample: bool
    failover: bool = True
    asked: bool = False


# kind -> accounting. Only what the backend itself did wrong counts against it; what the caller
# did (a short deadline, a disconnect, a bad request, an endpoint the backend does not serve)
# says nothing about the backend and is neither a failure nor a latency sample. A 500, an answer
# that is no answer or an error event may be the backend's reaction to one caller's input
# (`asked`), and so may a timeout: how long the first token or a whole answer takes depends on
# what was asked (a 300 KB prompt's prefill, a long answer without max_tokens, a reasoning model's
# thinking before its first delta: three such requests of one tenant ejected a healthy backend for
# everyone). Refused connections, resets and cuts are the backend's own.
OUTCOMES: dict[Kind, Outcome] = {
    Kind.OK: Outcome(health=False, sample=True, failover=False),
    Kind.CONNECT: Outcome(health=True, sample=True),
    Kind.RESET_BEFORE_HEADERS: Outcome(health=True, sample=True),
    # A timeout at a live deadline short of the backend's `first_token_ms` (relay/report.py
    # `cut_short`) is blamed on LIVE_DEADLINE: an ejection of such timeouts waits for a probe.
    Kind.TIMEOUT: Outcome(health=True, sample=True, asked=True),
    Kind.FIRST_TOKEN_TIMEOUT: Outcome(health=True, sample=True, asked=True),
    Kind.HTTP_5XX: Outcome(health=True, sample=True, asked=True),
    Kind.HTTP_503: Outcome(health=True, sample=True),
    Kind.HTTP_429: Outcome(health=False, sample=False),
    # Our key or the backend is wrong, or a WAF or an ingress rule in front of it refused what one
    # caller sent: a request probe tells which (it fails too when the key is wrong).
    Kind.HTTP_401: Outcome(health=True, sample=True, asked=True),
    Kind.HTTP_403: Outcome(health=True, sample=True, asked=True),
    Kind.HTTP_408: Outcome(health=True, sample=True, asked=True),
    Kind.HTTP_404: Outcome(health=False, sample=False),
    Kind.HTTP_405: Outcome(health=False, sample=False),
    Kind.MALFORMED: Outcome(health=True, sample=True, asked=True),
    # Past a cap on what we read: how big an answer is depends on what was asked (echo of a long
    # prompt, a large embedding batch, a long think held before the first token), so it says
    # nothing sure about the backend; another may still answer within the cap.
    Kind.TOO_LARGE: Outcome(health=False, sample=False),
    Kind.ERROR_EVENT: Outcome(health=True, sample=True, asked=True),
    Kind.CUT: Outcome(health=True, sample=True),
    Kind.DISCONNECT: Outcome(health=True, sample=True),
    Kind.CUT_MID_STREAM: Outcome(health=True, sample=True, failover=False),
    Kind.ERROR_EVENT_MID_STREAM: Outcome(health=True, sample=True, failover=False, asked=True),
    Kind.REJECTED: Outcome(health=False, sample=False, failover=False),
    Kind.CALLER_DEADLINE: Outcome(health=False, sample=False, failover=False),
    Kind.CLIENT_DISCONNECT: Outcome(health=False, sample=False, failover=False),
    Kind.LOST: Outcome(health=False, sample=False, failover=False),
    # A sampled answer, not a fault.
    Kind.MISMATCH: Outcome(health=False, sample=False),
    Kind.CONTEXT_LENGTH: Outcome(health=False, sample=False),
    Kind.KEY_REVOKED: Outcome(health=False, sample=False, failover=False),
}


def outcome(kind: str) -> Outcome:
    """The accounting of an outcome kind, or of its label (`http_502` stands for HTTP_5XX)."""
    try:
        return OUTCOMES[Kind(kind)]
    except ValueError:
        if kind.startswith("http_5"):
            return OUTCOMES[Kind.HTTP_5XX]
        raise KeyError(f"unknown attempt outcome {kind!r}: add it to health.Kind and health.OUTCOMES") from None


@dataclass
class Health:
    """Health state of one backend. Every method is O(1) and does no I/O."""

    failures_to_eject: int = 3
    eject_s: float = 10.0
    clock: Callable[[], float] = time.monotonic
    max_eject_s: float = 30.0
    jitter: float = 0.2  # an ejection lasts between (1 - jitter) and 1 times its back-off
    rng: random.Random = field(default_factory=random.Random)
    consecutive_failures: int = 0
    ejections: int = 0  # ejections in a row without a success: drives the back-off
    ejected_until: float = 0.0
    ejected_at: float = 0.0  # when the last ejection began (probes wait an interval after it)
    cooldown_until: float = 0.0  # from an upstream Retry-After
    ready: bool = True  # False while a launched backend starts
    parent: "Health | None" = None  # the backend's own health, for a model's
    # While not ready: why the last launch failed (one line; "" while it simply starts) and when
    # the launcher tries again (on `clock`), so a 503 and /readyz say more than "starting".
    start_failure: str = ""
    start_retry_at: float = 0.0
    # A good request probe ended the current ejection: the trial that follows was its doing.
    probe_opened: bool = False
    # A trial that a good request probe opened failed: this backend passes probes while its real
    # requests fail, so its probes end no ejection until a real request succeeds.
    probes_misled: bool = False
    # An ejection by a run of `asked` failures that one tenant's requests alone met is checked at
    # once by a request probe of the gateway's own: if it is answered, the ejection is undone and
    # that tenant's failures count for nothing for `max_eject_s` (a caller must not eject a
    # backend for everyone by sending what it answers 500 to). The runtime turns it off where
    # request probes are off (nothing would decide) and where a policy has fewer than two tenants.
    corroborate: bool = True
    run_tenant: str | None = None  # the tenant every failure of the current run came from, if one
    run_mixed: bool = False  # the run has failures of several tenants
    # Failures of the run no caller can be blamed for (the backend's own kinds, a probe's). Fewer
    # than failures_to_eject of them leave a run of one tenant's requests that tenant's: one such
    # failure, or one misread, could otherwise take the probe's verification from a run a caller
    # made (a by-id call's oversized answer read as a disconnect did: review helper's repro).
    run_unblamed: int = 0
    run_deadline: int = 0  # the run's timeouts at live deadlines (LIVE_DEADLINE's)
    # The tenant whose requests alone caused the current ejection (LIVE_DEADLINE: timeouts at live
    # deadlines alone), while a probe has not confirmed or undone it (None: nothing waits for a probe).
    suspect: str | None = None
    suspect_deadline: bool = False  # the run that ejected it had timeouts at live deadlines
    # The ejection waiting for a probe is a failed half-open trial's (that a good request probe let
    # through): answered, the backend is half-open again, not healthy; the run goes on, so another
    # tenant's failed trial corroborates it.
    suspect_trial: bool = False
    forgiven: str | None = None  # the tenant whose failures a probe showed to be its requests' doing
    forgiven_until: float = 0.0
    deadline_forgiven_until: float = 0.0  # until when timeouts at live deadlines count for nothing

    def starting_reason(self, *, detail: bool = True) -> str:
        """Why a backend that is not ready cannot answer: starting, or its failed launch and retry.

        `detail=False` leaves out the launch failure's own words (they may name an address or an OS
        error): for tenants' 503s; /readyz and /admin/backends, the operator's views, keep them."""
        if not self.start_failure:
            return "the backend is starting"
        wait = self.start_retry_at - self.clock()
        when = f"retrying in {wait:.0f} s" if wait >= 0.5 else "retrying now"
        why = f": {self.start_failure}" if detail else " (/readyz says why)"
        return f"the backend could not be launched{why}; {when}"

    def starting_retry_s(self) -> float | None:
        """Seconds until the launcher's next try after a failed launch (at least 1), else None."""
        if not self.start_failure:
            return None
        return max(1.0, self.start_retry_at - self.clock())

    def for_model(self) -> Health:
        """A new health for one of this backend's models, with this one's settings and as its parent."""
        h = Health(self.failures_to_eject, self.eject_s, self.clock, self.max_eject_s, self.jitter, self.rng, parent=self)
        h.corroborate = self.corroborate
        return h

    def report_success(self) -> None:
        """A request (not a probe) was answered: the backend is fully healthy again."""
        self.consecutive_failures = 0
        self.ejections = 0
        self.ejected_until = 0.0
        self.probe_opened = self.probes_misled = False
        self.suspect, self.suspect_deadline, self.suspect_trial = None, False, False
        self._end_run()

    def report_failure(self, tenant: str | None = None, *, asked: bool = False) -> None:
        """A request failed or timed out in a way that is the backend's fault. `tenant`: whose
        request it was (LIVE_DEADLINE: a timeout at a deadline set from live data); `asked`: the
        kind may have been caused by what the request held."""
        self._failure(trial=True, tenant=tenant if asked else None)

    @property
    def verifying(self) -> bool:
        """The current ejection waits for a request probe to confirm it or undo it."""
        return self.suspect is not None

    def _end_run(self) -> None:
        self.run_tenant, self.run_mixed, self.run_unblamed, self.run_deadline = None, False, 0, 0

    def _failure(self, *, trial: bool, tenant: str | None = None) -> None:
        now = self.clock()
        if now < self.ejected_until:
            return  # started before the ejection: it tells us nothing new
        if tenant is not None and tenant == self.forgiven and now < self.forgiven_until:
            return  # a probe showed this tenant's failures to be its requests' doing, not long ago
        if tenant == LIVE_DEADLINE and now < self.deadline_forgiven_until:
            return  # a probe answered after such timeouts, not long ago: the deadline's doing
        self.consecutive_failures += 1
        if self.consecutive_failures == 1:
            self._end_run()
        if tenant is None:  # the backend's own kind of failure (or a probe's): no caller to blame
            self.run_unblamed += 1
        elif tenant == LIVE_DEADLINE:  # anyone's, and with one tenant's: still that tenant's run
            self.run_deadline += 1
        elif self.run_tenant is None:
            self.run_tenant = tenant
        elif tenant != self.run_tenant:
            self.run_mixed = True
        if self.ejections > 0 or self.consecutive_failures >= self.failures_to_eject:
            # One tenant's requests alone: a probe confirms the ejection or undoes it, at once. In
            # half-open, only a trial a good request probe let through that a tenant's own request
            # failed (its one request is the run, unless an earlier such trial's was cleared).
            one = (self.corroborate and not self.run_mixed and (self.run_tenant is not None or self.run_deadline > 0)
                   and self.run_unblamed < self.failures_to_eject)
            tenants_trial = trial and self.ejections > 0 and tenant is not None
            alone = one and (self.ejections == 0 or (tenants_trial and self.probe_opened))
            if trial and self.probe_opened and not alone:
                self.probes_misled = True  # the probe said "back", the real request said otherwise
            elif one and tenants_trial:
                # A trial the back-off let through that one tenant's request failed is no word
                # against the probes (it may be that tenant's poison): a probe may open the next
                # trial, whose failure by one tenant a probe then verifies.
                self.probes_misled = False
            self.suspect = (self.run_tenant or LIVE_DEADLINE) if alone else None
            self.suspect_deadline = alone and self.run_deadline > 0
            self.suspect_trial = alone and self.ejections > 0
            if not self.suspect_trial:
                self._end_run()
            self._eject(now)  # a failed half-open trial re-ejects at once, for longer

    def report_probe(self, ok: bool, *, request: bool = False) -> None:
        """An active probe's result; `request`: it was a minimal real request to this model (a
        one-token completion), not the backend's model list.

        A good request probe ends any ejection (half-open: the next real request decides; the
        back-off is kept, so a failed trial re-ejects for longer), unless an earlier probe proved
        misleading (see `probes_misled`). A good model-list probe ends only a first ejection: a
        model list that answers is no evidence that completions work. Neither resets the count of
        real failures. A failed probe counts as a failure unless the backend is already out.
        While `verifying`, a good request probe undoes the ejection instead (and forgives the
        suspect tenant's failures for `max_eject_s`): back to healthy, or to half-open for a failed
        trial's (`suspect_trial`); a failed one confirms it."""
        if not ok:
            if self.suspect is not None:  # an ejection waiting for this word stands; its run ends
                self.suspect, self.suspect_deadline, self.suspect_trial = None, False, False
                self._end_run()
            self._failure(trial=False)  # a probe failing in half-open re-ejects, but misleads nobody
            return
        if request and self.verifying:
            # The gateway's own request is answered: the failures were its caller's requests' doing
            # (or the live deadline's).
            until = self.clock() + self.max_eject_s
            if self.suspect != LIVE_DEADLINE:
                self.forgiven, self.forgiven_until = self.suspect, until
            if self.suspect_deadline:
                self.deadline_forgiven_until = until
            if self.suspect_trial:  # back to half-open, as the probe that let the trial through left it
                self.ejections -= 1
                self.ejected_until, self.probe_opened = 0.0, True
            else:
                self.ejections, self.ejected_until, self.consecutive_failures = 0, 0.0, 0
            self.suspect, self.suspect_deadline, self.suspect_trial = None, False, False
            return
        if self.clock() >= self.ejected_until:
            return
        if (request and not self.probes_misled) or self.ejections <= 1:
            # Only a first ejection ends early on weaker evidence: a backend whose cheap probe works
            # while its real requests keep failing would otherwise get a trial request every probe
            # interval, whatever its back-off says.
            self.ejected_until = 0.0
            self.probe_opened = request

    def _eject(self, now: float) -> None:
        self.ejections += 1
        self.ejected_at = now
        self.probe_opened = False
        backoff = min(self.max_eject_s, self.eject_s * 2.0 ** min(self.ejections - 1, 30))
        self.ejected_until = now + backoff * (1.0 - self.jitter * self.rng.random())

    def clear(self, now: float) -> bool:
        """Fully healthy at `now` (the selector's fast path): ready, never ejected, not cooling."""
        p = self.parent
        return (
            self.ready and not self.ejections and now >= self.cooldown_until and now >= self.ejected_until
            and (p is None or p.clear(now))
        )

    def is_ready(self) -> bool:
        """False while the backend starts (a model's health follows its backend's)."""
        return self.ready and (self.parent is None or self.parent.is_ready())

    def cool_down(self, seconds: float) -> None:
        """The backend asked for a pause (429/503 Retry-After): send it nothing for that long."""
        self.cooldown_until = max(self.cooldown_until, self.clock() + seconds)

    def cooling_for(self) -> float:
        """Seconds left of an upstream-requested pause (0 when none)."""
        own = max(0.0, self.cooldown_until - self.clock())
        return own if self.parent is None else max(own, self.parent.cooling_for())

    def available_in(self) -> float:
        """Seconds until it may take traffic again (0 when it may now; inf while starting)."""
        if not self.ready:
            return math.inf
        now = self.clock()
        own = max(0.0, self.ejected_until - now, self.cooldown_until - now)
        return own if self.parent is None else max(own, self.parent.available_in())

    @property
    def healthy(self) -> bool:
        """Ready and not ejected (a cooling backend is healthy, only paused)."""
        own = self.ready and self.clock() >= self.ejected_until
        return own and (self.parent is None or self.parent.healthy)

    @property
    def probing(self) -> bool:
        """Half-open: back from an ejection, no request has succeeded since."""
        own = self.ejections > 0 and self.clock() >= self.ejected_until
        return own or (self.parent is not None and self.parent.probing)

    def state(self) -> str:
        """One of starting, ejected, cooling, probing, healthy."""
        if self.parent is not None:
            up = self.parent.state()
            if up in ("starting", "ejected"):
                return up
        if not self.ready:
            return "starting"
        now = self.clock()
        if now < self.ejected_until:
            return "ejected"
        if now < self.cooldown_until or (self.parent is not None and up == "cooling"):
            return "cooling"
        if self.ejections > 0 or (self.parent is not None and up == "probing"):
            return "probing"
        return "healthy"
