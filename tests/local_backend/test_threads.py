"""Thread counts picked per forward pass: the picker's choices, the default ladder, and an engine that
switches counts mid-stream without changing a token."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
import torch

from local_backend.boot import thread_picker, usable_cores
from local_backend.models import LoadedModel
from local_backend.protocol import GenerationRequest
from local_backend.threads import ThreadPicker

from .conftest import chat_ids
from .test_engine import QUESTIONS, _run

DECODE1 = ("decode", 1)


def _drive(picker: ThreadPicker, key: object, cost: dict[int, float], passes: int) -> list[int]:
    """Run ``passes`` passes of kind ``key``, each costing ``cost[threads]``; return the counts picked."""
    picked = []
    for _ in range(passes):
        n = picker.pick(key)
        picker.record(key, n, cost[n])
        picked.append(n)
    return picked


def test_a_single_count_is_fixed_and_not_adaptive() -> None:
    picker = ThreadPicker((3,))
    assert not picker.adaptive and picker.describe() == "3 torch threads"
    assert ThreadPicker((1,)).describe() == "1 torch thread"
    assert ThreadPicker((1, 2)).describe() == "1/2 torch threads (picked per pass by live timings)"
    assert _drive(picker, DECODE1, {3: 1.0}, 5) == [3] * 5


@pytest.mark.parametrize("choices", [(), (0, 1), (-2,)])
def test_choices_must_be_positive_counts(choices: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="positive"):
        ThreadPicker(choices)


def test_bad_exploration_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="explore_every"):
        ThreadPicker((1, 2), explore_every=1)
    with pytest.raises(ValueError, match="alpha"):
        ThreadPicker((1, 2), alpha=0)


def test_tries_every_count_then_keeps_to_the_cheapest_and_retries_on_schedule() -> None:
    picker = ThreadPicker((2, 1), explore_every=8)
    assert picker.choices == (1, 2) and picker.adaptive
    picked = _drive(picker, DECODE1, {1: 5.0, 2: 4.0}, 32)
    assert picked[:2] == [1, 2]  # each count once, in order
    # Then 2 (cheaper); 1 is due again 8 x 5/4 = 10 passes after it last ran.
    assert [i + 1 for i, n in enumerate(picked) if n == 1] == [1, 11, 21, 31]
    assert picker.estimates(DECODE1) == {1: 5.0, 2: 4.0}


def test_moves_to_one_thread_when_the_other_core_gets_busy_and_back_when_it_frees() -> None:
    picker = ThreadPicker((1, 2), explore_every=8, alpha=0.3)
    assert _drive(picker, DECODE1, {1: 5.0, 2: 4.0}, 15)[-1] == 2
    busy = _drive(picker, DECODE1, {1: 5.0, 2: 12.0}, 40)
    assert busy[:2] == [2, 1]  # one slow pass lifts 2's estimate above 1's
    assert busy.count(2) <= 5  # afterwards 2 only on its retries, further apart as it reads slower
    idle = _drive(picker, DECODE1, {1: 5.0, 2: 4.0}, 160)
    assert idle[-20:].count(2) >= 17  # back on 2, retrying 1 about every 10 passes


def test_retries_take_about_one_explore_every_th_of_the_time_however_slow_the_other_counts() -> None:
    picker = ThreadPicker((1, 2, 4), explore_every=10)
    cost = {1: 1.0, 2: 2.0, 4: 10.0}
    picked = _drive(picker, DECODE1, cost, 2000)[3:]  # after each count's first try
    spent = sum(cost[n] for n in picked)
    retries = sum(cost[n] for n in picked if n != 1)
    assert retries / spent <= 1.5 / 10
    assert 0 < picked.count(4) < picked.count(2)  # the 10x slower count is retried least often


def test_kinds_of_pass_learn_separately_and_passes_count_by_kind() -> None:
    picker = ThreadPicker((1, 2), explore_every=50)
    _drive(picker, ("decode", 1), {1: 5.0, 2: 4.0}, 10)
    _drive(picker, ("decode", 8), {1: 12.0, 2: 8.0}, 10)
    _drive(picker, ("prefill", 6), {1: 0.5, 2: 0.9}, 10)
    assert picker.pick(("decode", 8)) == 2 and picker.pick(("prefill", 6)) == 1
    assert picker.estimates(("decode", 16)) == {1: None, 2: None}
    assert picker.passes() == {("decode", 1): 2, ("decode", 2): 18, ("prefill", 1): 9, ("prefill", 2): 1}


def test_a_new_kind_of_pass_starts_on_its_nearest_measured_siblings_best_count() -> None:
    picker = ThreadPicker((1, 2, 4), explore_every=50)
    _drive(picker, ("prefill", 5), {1: 3.0, 2: 2.0, 4: 1.0}, 6)
    _drive(picker, ("prefill", 9), {1: 1.0, 2: 2.0, 4: 3.0}, 6)
    assert picker.pick(("prefill", 6)) == 4  # nearest: 5
    assert picker.pick(("prefill", 8)) == 1  # nearest: 9
    assert picker.pick(("decode", 6)) == 1  # no decode key measured yet: the first untried count
    picker.record(("prefill", 6), 4, 1.0)
    assert picker.pick(("prefill", 6)) == 1  # then the counts it has not tried, in order
    assert picker.pick("other") == 1  # keys of another shape: in order


def test_zero_negative_and_non_finite_costs_are_clamped_or_dropped() -> None:
    picker = ThreadPicker((1, 2), explore_every=4)
    picker.record(DECODE1, 1, float("nan"))
    picker.record(DECODE1, 2, float("inf"))
    assert picker.estimates(DECODE1) == {1: None, 2: None}
    picker.record(DECODE1, 1, 0.0)
    picker.record(DECODE1, 2, -1.0)
    picked = _drive(picker, DECODE1, {1: 0.0, 2: 5.0}, 200)
    assert picked.count(1) > 150 and picked.count(2) >= 1  # no division by zero; 2 was measured


def test_a_count_outside_the_choices_is_counted_but_not_learned() -> None:
    picker = ThreadPicker((1, 2))
    picker.record(DECODE1, 7, 0.001)
    assert picker.passes() == {("decode", 7): 1}
    assert picker.estimates(DECODE1) == {1: None, 2: None}


@pytest.mark.parametrize(
    ("threads", "cores", "choices"),
    [
        (None, 1, (1,)),
        (None, 2, (1, 2)),
        (None, 4, (1, 2, 3, 4)),
        (None, 16, (1, 2, 4, 8, 15, 16)),
        (3, 16, (3,)),
        (1, 2, (1,)),
    ],
)
def test_default_ladder_and_a_fixed_count(threads: int | None, cores: int, choices: tuple[int, ...]) -> None:
    assert thread_picker(threads, cores).choices == choices


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_the_command_line_refuses_a_thread_count_below_one(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    from local_backend.__main__ import _parser

    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--threads", value])
    assert "--threads" in capsys.readouterr().err
    assert _parser().parse_args(["serve", "--threads", "2"]).threads == 2


@pytest.mark.parametrize(
    ("files", "proc", "limit"),
    [
        ({"cpu.max": "100000 100000\n"}, "0::/\n", 1),
        ({"cpu.max": "150000 100000\n"}, "0::/\n", 2),  # 1.5 CPUs: 2 threads, the second throttled part of the time
        ({"cpu.max": "max 100000\n"}, "0::/\n", None),
        ({"cpu.max": "0 0\n"}, "0::/\n", None),
        ({"cpu.max": "garbage"}, "0::/\n", None),
        ({}, "0::/\n", None),
        # No cgroup namespace: the limit sits on the process's own cgroup, or on a parent of it.
        ({"system.slice/llm.service/cpu.max": "100000 100000\n"}, "0::/system.slice/llm.service\n", 1),
        ({"system.slice/cpu.max": "50000 100000\n", "system.slice/llm.service/cpu.max": "max 100000\n"},
         "0::/system.slice/llm.service\n", 1),
        # cgroup v1: the cpu controller's hierarchy.
        ({"cpu/cpu.cfs_quota_us": "50000\n", "cpu/cpu.cfs_period_us": "100000\n"}, "4:cpu,cpuacct:/\n", 1),
        ({"cpu/docker/abc/cpu.cfs_quota_us": "100000\n", "cpu/docker/abc/cpu.cfs_period_us": "100000\n"},
         "4:cpu,cpuacct:/docker/abc\n", 1),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, "4:cpu,cpuacct:/\n", None),
    ],
)
def test_a_cgroup_cpu_limit_caps_the_cores(tmp_path, files: dict[str, str], proc: str, limit: int | None) -> None:
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    (tmp_path / "self-cgroup").write_text(proc)
    unlimited = usable_cores(tmp_path / "nothing-here", tmp_path / "nothing-here")
    assert usable_cores(root, tmp_path / "self-cgroup") == (min(unlimited, limit) if limit else unlimited)


async def test_switching_counts_mid_stream_changes_no_token(tiny: LoadedModel, make_engine) -> None:
    requests = [GenerationRequest(chat_ids(tiny, q), max_tokens=24) for q in QUESTIONS]
    reference = await asyncio.gather(*(_run(make_engine(max_batch=8, threads=ThreadPicker((1,))), r) for r in requests[:1]))
    fixed = make_engine(max_batch=8, threads=ThreadPicker((1,)))
    alone = [await _run(fixed, r) for r in requests]
    assert alone[0] == reference[0]
    for quantize in ("none", "w8a16", "int8"):
        if quantize == "w8a16":
            from local_backend.llama.native import kernel

            if kernel() is None:
                continue
        one = make_engine(max_batch=8, quantize=quantize, threads=ThreadPicker((1,)))
        base = [await _run(one, r) for r in requests]
        # Exploring every 2nd pass: counts alternate within each stream, prefill and decode alike.
        switching = make_engine(max_batch=8, quantize=quantize, threads=ThreadPicker((1, 2), explore_every=2))
        mixed = await asyncio.gather(*(_run(switching, r) for r in requests))
        for (a_deltas, a_text), (b_deltas, b_text) in zip(base, mixed, strict=True):
            assert b_text == a_text, quantize
            assert b_deltas[-1] == a_deltas[-1], quantize
        passes = switching.threads.passes()
        assert passes[("decode", 1)] > 0 and passes[("decode", 2)] > 0, passes
        assert passes[("prefill", 1)] + passes[("prefill", 2)] == len(requests)


async def test_an_engine_without_a_picker_leaves_torch_threads_alone(make_engine, tiny: LoadedModel) -> None:
    torch.set_num_threads(1)
    engine = make_engine()
    assert engine.threads is None
    await _run(engine, GenerationRequest(chat_ids(tiny, "Hi"), max_tokens=4))
    assert torch.get_num_threads() == 1


async def test_metrics_show_passes_per_thread_count(make_engine, serve) -> None:
    server = serve(make_engine(max_batch=4, threads=ThreadPicker((1, 2), explore_every=2)))
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    await client.chat.completions.create(model="tiny-random", messages=[{"role": "user", "content": "Hi"}], max_tokens=6)
    await client.close()
    async with aiohttp.ClientSession() as session, session.get(f"{server.root}/metrics") as resp:
        text = await resp.text()
    series = [line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("local_backend_forward_passes_total{")]
    lines = {name: int(value) for name, value in series}
    assert lines['local_backend_forward_passes_total{model="tiny-random",pass="prefill",threads="1"}'] == 1
    decode = [v for k, v in lines.items() if 'pass="decode"' in k]
    assert len(decode) == 2 and sum(decode) == 5  # 6 tokens: one from prefill, 5 decode steps on both counts
