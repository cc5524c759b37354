"""The supervisor's side of a reload, in this process: its answer to /admin/reload when the reload
outlasts the time to answer, the rollback of a policy one worker rejects, and the trigger it
names to each worker. Fake workers are control sockets served here (control.serve_unix); the
supervisor is the real `_Supervisor`, never run (no worker process is spawned).
(tests/test_reload_edges_workers.py runs the same cases with real processes.)
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.process import control, serve
from gateway.process.workers import WorkerInfo, worker_socket
from gateway.web import api as web_api
from gateway.web.app import create_app
from gateway.web.keys import RELOADER


class _FakeWorker:
    """A worker's control socket: answers POST /reload after `delay_s`, refusing while `refuse`
    is set; records the `why` of each reload it was asked for."""

    def __init__(self, index: int, delay_s: float = 0.0, refuse: str | None = None) -> None:
        self.index, self.delay_s, self.refuse = index, delay_s, refuse
        self.asked: list[str | None] = []
        self.generation = 1

    async def reload(self) -> dict[str, Any]:
        self.asked.append(control.ASKED_BECAUSE.get())
        await asyncio.sleep(self.delay_s)
        if self.refuse is not None:
            return {"ok": False, "worker": self.index, "pid": 1000 + self.index, "policy_generation": self.generation,
                    "error": self.refuse}
        self.generation += 1
        return {"ok": True, "worker": self.index, "pid": 1000 + self.index, "policy_generation": self.generation}


class _Proc:
    """What `_Supervisor.procs` holds, for a worker that is not a process here."""

    pid = None
    exitcode = None

    def is_alive(self) -> bool:
        return True


@pytest.fixture
async def supervised(tmp_path: Path) -> Any:
    """A factory: (supervisor, fake workers) with those workers' sockets up."""
    runners: list[Any] = []

    async def make(*workers: _FakeWorker) -> serve._Supervisor:
        policy = tmp_path / "policy.yaml"
        policy.write_text(yaml.safe_dump({"backends": {"a": {"url": "http://127.0.0.1:9/v1", "models": ["m"]}},
                                          "reload": {"watch": False}}))
        control_dir = tmp_path / "control"
        control_dir.mkdir(mode=0o700)
        sup = serve._Supervisor(policy, "127.0.0.1", 0, len(workers), False, control_dir)
        for w in workers:
            runners.append(await control.serve_unix(worker_socket(control_dir, w.index), {("POST", "/reload"): w.reload}))
            sup.procs[w.index] = (_Proc(), time.monotonic())
        return sup

    yield make
    for r in runners:
        await r.cleanup()


def _status(answer: dict[str, Any]) -> tuple[int, str | None, str]:
    """What web/api.py's admin_reload makes of the supervisor's answer: (status, code, message)."""
    if answer.get("ok"):
        return 200, None, ""
    sup, workers = answer.get("supervisor", {}), answer.get("workers", [])
    detail = next((str(r["error"]) for r in [sup, *workers] if r.get("error")), "")
    err = web_api.reload_failure(sup, workers, detail)
    return err.status, err.code, err.message


def test_the_supervisor_answers_before_the_worker_stops_waiting():
    assert serve._answer_within_s() <= web_api.CONTROL_TIMEOUT_S - 2.0


async def test_a_slow_reload_is_answered_in_time_and_goes_on(supervised, monkeypatch, caplog):
    workers = (_FakeWorker(0, delay_s=0.1), _FakeWorker(1, delay_s=1.5))
    sup = await supervised(*workers)
    monkeypatch.setattr(serve, "_answer_within_s", lambda: 0.6)
    caplog.set_level(logging.INFO, "gateway")
    started = time.monotonic()
    answer = await sup.answer_reload()
    assert time.monotonic() - started < 1.2
    status, code, message = _status(answer)
    assert (status, code) == (503, "reload_incomplete") and "worker-1.sock did not answer" in message, message
    assert "the reload goes on" in message and "reloading the workers" in message
    assert answer["workers"][0]["ok"] is True and answer["workers"][1]["pending"] is True  # who took it, who not yet
    for _ in range(50):
        await asyncio.sleep(0.1)
        if "is in force in all 2 workers" in caplog.text:
            break
    assert "answered before it ended, is in force in all 2 workers" in caplog.text
    assert [w.generation for w in workers] == [2, 2]
    await sup._end_background()


async def test_a_reload_queued_behind_another_says_so(supervised, monkeypatch):
    sup = await supervised(_FakeWorker(0, delay_s=1.0), _FakeWorker(1, delay_s=1.0))
    monkeypatch.setattr(serve, "_answer_within_s", lambda: 0.4)
    first = asyncio.create_task(sup.reload_all("SIGHUP"))
    await asyncio.sleep(0.1)
    status, code, message = _status(await sup.answer_reload())
    assert (status, code) == (503, "reload_incomplete") and "waiting for another reload to end" in message, message
    assert (await first)["ok"] is True
    await sup._end_background()


async def test_workers_done_and_replicas_pending_is_a_success(supervised, monkeypatch):
    """Every worker took it; only the other replicas' answers are still awaited: 200, with a
    `pending` entry in `replicas`."""
    sup = await supervised(_FakeWorker(0), _FakeWorker(1))
    monkeypatch.setattr(serve, "_answer_within_s", lambda: 0.5)
    monkeypatch.setattr(sup.peers, "url", "redis://127.0.0.1:9/0")  # `enabled`: announcements expected

    async def slow_announce() -> list[dict[str, Any]]:
        await asyncio.sleep(1.0)
        return [{"ok": True, "node": "other"}]

    monkeypatch.setattr(sup.peers, "announce", slow_announce)
    answer = await sup.answer_reload()
    assert _status(answer)[0] == 200
    assert answer["replicas"][0]["pending"] is True and "announcing" in answer["replicas"][0]["error"]
    await sup._end_background()


async def test_a_rejection_seen_before_the_answer_is_a_400(supervised, monkeypatch):
    sup = await supervised(_FakeWorker(0, delay_s=1.5), _FakeWorker(1, refuse="classifier weights w.json: unreadable"))
    monkeypatch.setattr(serve, "_answer_within_s", lambda: 0.5)
    status, code, message = _status(await sup.answer_reload())
    assert (status, code) == (400, "invalid_policy") and "unreadable" in message and "go back" in message, message
    await sup._end_background()


async def test_a_policy_one_worker_rejects_is_rolled_back_where_it_was_taken(supervised):
    ok, refusing = _FakeWorker(0), _FakeWorker(1, refuse="classifier weights w.json: unreadable")
    sup = await supervised(ok, refusing)
    gen, data = sup.generation, sup.data
    sup.path.write_text(yaml.safe_dump({"backends": {"b": {"url": "http://127.0.0.1:9/v1", "models": ["m"]}}}))
    out = await sup.reload_all("SIGHUP")
    assert out["ok"] is False and out["supervisor"]["ok"] is False
    assert ok.asked == ["SIGHUP, through the supervisor",
                        "rollback to the policy in force: worker 1 rejected the one of SIGHUP, through the supervisor"]
    assert refusing.asked == ["SIGHUP, through the supervisor"]  # it never left the policy in force
    assert out["workers"][0]["rolled_back"] is True and out["workers"][0]["ok"] is False
    assert (sup.generation, sup.data, sup.snapshot.read_bytes()) == (gen, data, data)
    status, code, _ = _status(out)
    assert (status, code) == (400, "invalid_policy")


async def test_every_trigger_reaches_the_workers(supervised):
    w = _FakeWorker(0)
    sup = await supervised(w)
    for trigger in ("SIGHUP", "file change", "announced by host:1:ab", "the reload channel came back"):
        await sup.reload_all(trigger)
    await sup.answer_reload()
    assert w.asked == ["SIGHUP, through the supervisor", "file change, through the supervisor",
                       "announced by host:1:ab, through the supervisor", "the reload channel came back, through the supervisor",
                       "/admin/reload, through the supervisor"]


async def test_a_worker_logs_the_trigger_its_supervisor_named(tmp_path, caplog):
    """The worker's reload handler (web/app.py) names no trigger of its own that fits every reload:
    the `why` of the control request names it; a reload not asked over the control channel keeps
    its caller's words."""
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump({"backends": {"a": {"url": "http://127.0.0.1:9/v1", "models": ["m"]}}, "reload": {"watch": False}}))
    app = create_app(path, worker=WorkerInfo(0, 2, tmp_path))  # not started: no sockets needed
    reloader = app[RELOADER]
    caplog.set_level(logging.INFO, "gateway.reload")

    async def handler() -> dict[str, Any]:
        ok, _ = await reloader.reload("admin, through the supervisor")
        return {"ok": ok}

    sock = tmp_path / "w.sock"
    runner = await control.serve_unix(sock, {("POST", "/reload"): handler})
    try:
        assert (await control.ask(sock, "POST", control.why("/reload", "file change, through the supervisor"), 5))["ok"]
        assert (await control.ask(sock, "POST", "/reload", 5))["ok"]
    finally:
        await runner.cleanup()
    await reloader.reload("SIGHUP")
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("policy reloaded")]
    assert [line.split(":")[0] for line in lines] == [
        "policy reloaded (file change, through the supervisor)", "policy reloaded (admin, through the supervisor)",
        "policy reloaded (SIGHUP)"]
    assert control.ASKED_BECAUSE.get() is None
