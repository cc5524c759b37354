"""Benchmark the local engine's thread count: fixed 1, fixed N (every core) and picked per pass (not a test).

One engine (the default mode) serves rounds of 1 and 8 concurrent streams of 64 tokens from the
same process's event loop, as the server does; each round runs every setting back to back, so
the machine's drift hits all of them alike. With ``--busy-neighbour`` a busy loop in another
process holds a core for the whole run (what a gateway under load, or anything else on the host,
does to the model's second thread). Aggregate tokens/s are medians over ``--repeat`` rounds.

    flock /tmp/bench.lock .venv/bin/python bench/local_threads.py [--repeat 3] [--busy-neighbour]

Prints a markdown table with each setting's ratio to fixed 1 thread; writes JSON to
bench/results/local_threads[_busy].json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from local_model import CONCURRENT, _aggregate  # noqa: E402

BUSY_LOOP_S = 900  # the neighbour ends by itself even if this process is killed


async def _measure(engine: Any, settings: dict[str, Any], repeat: int) -> dict[str, dict[str, list[float]]]:
    from local_backend.checkset import chat_prompt_ids

    stories = [chat_prompt_ids(engine.tokenizer, f"Write a short story about a robot number {i}.") for i in range(CONCURRENT)]
    runs: dict[str, dict[str, list[float]]] = {name: {"agg1": [], "agg8": []} for name in settings}
    await _aggregate(engine, stories)  # every row count's first passes, before anything is timed
    for _ in range(repeat):
        for name, make in settings.items():
            engine.threads = make()
            await _aggregate(engine, stories[:1])  # the picker's first tries, untimed
            runs[name]["agg1"].append(await _aggregate(engine, stories[:1]))
            runs[name]["agg8"].append(await _aggregate(engine, stories))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--busy-neighbour", action="store_true", help="hold one core with a busy loop in another process")
    args = parser.parse_args()

    from local_backend.boot import EngineSettings, build_engine, thread_picker, usable_cores
    from local_backend.threads import ThreadPicker

    cores = usable_cores()
    settings = {
        "1 thread": lambda: ThreadPicker((1,)),
        f"{cores} threads": lambda: ThreadPicker((cores,)),
        "picked per pass (default)": lambda: thread_picker(None, cores),
    }
    engine = build_engine(EngineSettings("smollm2-135m-instruct", "auto", "cpu", None, 16, 256), lambda _: None)
    neighbour = None
    if args.busy_neighbour:
        busy = f"import time\nend = time.time() + {BUSY_LOOP_S}\nwhile time.time() < end: pass"
        neighbour = subprocess.Popen([sys.executable, "-c", busy])
    try:
        runs = asyncio.run(_measure(engine, settings, args.repeat))
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
        engine.close()

    base = {k: statistics.median(runs["1 thread"][k]) for k in ("agg1", "agg8")}
    lines = [
        f"Local engine, {cores} cores, {'one core held by a busy neighbour' if args.busy_neighbour else 'nothing else running'}, "
        f"medians of {args.repeat} rounds (aggregate tokens/s, 64 tokens per stream, TTFT included):",
        "",
        "| threads | 1 stream | vs 1 thread | 8 streams | vs 1 thread | 8/1 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in runs.items():
        a1, a8 = statistics.median(r["agg1"]), statistics.median(r["agg8"])
        lines.append(f"| {name} | {a1:.1f} | {a1 / base['agg1']:.2f}x | {a8:.1f} | {a8 / base['agg8']:.2f}x | {a8 / a1:.1f}x |")
    print("\n".join(lines))
    out = Path(__file__).parent / "results" / f"local_threads{'_busy' if args.busy_neighbour else ''}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"cores": cores, "busy_neighbour": args.busy_neighbour, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
