"""`specd serve` with one test-only route, GET /_probe, for leak checks.

Run as `python -m tests.support.probe_serve serve ARGS...` from the repo root
(`SpecdServer(..., probe=True)` does): the same CLI,
app and engine as `specd serve`; the app factory is wrapped so that the app
also answers /_probe with the live asyncio tasks and threads and the size of
every per-request table the engine keeps. Nothing in the product exposes this.
"""

from __future__ import annotations

import asyncio
import gc
import sys
import threading

import server.app
from server import cli

_product_create_app = server.app.create_app


def snapshot(state) -> dict:
    """Counts a leak would grow: tasks, threads, objects, and the engine's per-request state."""
    counts = {
        "tasks": len(asyncio.all_tasks()),
        "task_names": sorted(_describe(task) for task in asyncio.all_tasks()),
        "thread_names": sorted(thread.name for thread in threading.enumerate()),
        "threads": threading.active_count(),
        "gc_objects": len(gc.get_objects()),
    }
    engine = state.engine
    if engine is None:
        return counts
    scheduler = engine.scheduler
    proposer = getattr(engine.executor, "proposer", None)
    counts.update(
        streams=len(engine._streams),
        timings=engine.recorder.num_tracked,
        requests=len(scheduler._requests),
        waiting=len(scheduler.waiting),
        running=len(scheduler.running),
        aborted=len(scheduler._aborted),
        # Every block free (cached or not) once nothing runs: a leak holds a reference.
        blocks_in_use=scheduler.blocks.num_used,
        block_references=sum(scheduler.blocks.ref_count),
        policy_states=len(scheduler.policy.estimates.rows),
        proposer_states=len(getattr(proposer, "_computed", {})),
        kv_usage=scheduler.kv_usage,
        engine_running=engine.is_running,
    )
    return counts


def _describe(task: asyncio.Task) -> str:
    coro = task.get_coro()
    return f"{task.get_name()}:{getattr(coro, '__qualname__', type(coro).__name__)}"


def create_probed_app(settings, on_fatal=None):
    app = _product_create_app(settings, on_fatal)

    @app.get("/_probe", include_in_schema=False)
    async def probe() -> dict:
        return snapshot(app.state.specd)

    return app


server.app.create_app = create_probed_app

if __name__ == "__main__":
    sys.exit(cli.main())
