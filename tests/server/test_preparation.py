"""`server.preparation`: the shared preparation thread takes tenants in turn, holds a bounded queue
that sheds the greediest tenant's newest job first, and never runs a job whose caller has gone."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import pytest

from server.errors import ServiceUnavailableError
from server.preparation import PreparationQueue


@pytest.fixture
async def gated() -> AsyncIterator[tuple[PreparationQueue, threading.Event, list[str]]]:
    """A queue of at most 3 whose worker is held by tenant 'a''s first job until the event is set;
    every job appends its name to the list when it runs."""
    queue, gate, ran = PreparationQueue(3), threading.Event(), []
    holding = asyncio.ensure_future(queue.run("a", gate.wait))
    while queue.waiting:  # the gate job has started when nothing waits
        await asyncio.sleep(0)
    yield queue, gate, ran
    gate.set()
    await holding
    queue.shutdown()


def job(queue: PreparationQueue, ran: list[str], tenant: str, name: str) -> asyncio.Future[str]:
    def work() -> str:
        ran.append(name)
        return name

    return asyncio.ensure_future(queue.run(tenant, work))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_tenants_take_turns_however_many_jobs_one_queues(gated):
    queue, gate, ran = gated
    jobs = [job(queue, ran, "a", f"a{i}") for i in range(3)]
    await settle()
    queue.max_waiting = 4  # room for the other tenant's one job
    jobs.append(job(queue, ran, "b", "b0"))
    await settle()
    gate.set()
    assert await asyncio.gather(*jobs) == ["a0", "a1", "a2", "b0"]
    assert ran == ["a0", "b0", "a1", "a2"]  # a FIFO would run b0 last


async def test_a_full_queue_sheds_the_greediest_tenants_newest_job(gated):
    queue, gate, ran = gated
    jobs = [job(queue, ran, "a", f"a{i}") for i in range(3)]
    await settle()
    assert queue.waiting == 3
    with pytest.raises(ServiceUnavailableError) as refused:  # its own tenant holds the most
        await queue.run("a", ran.append, "a3")
    assert refused.value.status_code == 503 and refused.value.headers == {"Retry-After": "1"}
    assert refused.value.code == "queue_full"
    newcomer = job(queue, ran, "b", "b0")  # another tenant's first job displaces a's newest
    await settle()
    assert jobs[2].done() and isinstance(jobs[2].exception(), ServiceUnavailableError)
    assert queue.waiting == 3
    gate.set()
    assert await asyncio.gather(jobs[0], jobs[1], newcomer) == ["a0", "a1", "b0"]
    assert "a2" not in ran and "a3" not in ran


async def test_a_job_whose_caller_has_gone_leaves_the_queue_and_never_runs(gated):
    queue, gate, ran = gated
    left, stays = job(queue, ran, "a", "left"), job(queue, ran, "b", "stays")
    await settle()
    left.cancel()
    await settle()
    assert queue.waiting == 1  # its place is free at once, not when its turn comes
    gate.set()
    assert await stays == "stays"
    assert ran == ["stays"]


async def test_a_jobs_exception_reaches_its_caller_and_the_queue_goes_on():
    queue = PreparationQueue(2)

    def fail() -> None:
        raise ValueError("bad grammar")

    with pytest.raises(ValueError, match="bad grammar"):
        await queue.run("a", fail)
    assert await queue.run("a", sum, [1, 2]) == 3
    queue.shutdown()


class Client:
    """The ASGI side of one HTTP request: its body is read; `leave()` disconnects it."""

    def __init__(self, tenant: str):
        self.left = asyncio.Event()
        self.scope = {"type": "http", "method": "POST", "path": "/", "headers": [], "specd.tenant": tenant}

    async def receive(self) -> dict:
        await self.left.wait()
        return {"type": "http.disconnect"}

    def request(self):
        from starlette.requests import Request

        return Request(self.scope, self.receive)


async def test_render_waits_its_tenants_turn_is_shed_when_full_and_unqueued_when_its_client_leaves(gated):
    from types import SimpleNamespace

    from server.protocol import CompletionRequest
    from server.serving import ClientDisconnected, ServingContext
    from server.serving_completions import render_completion

    queue, gate, ran = gated
    queue.max_waiting = 1
    encoded: list[str] = []
    ctx = SimpleNamespace(prep=queue, check_model=lambda name: None, check_text_size=lambda n, param: None)
    ctx.tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens: encoded.append(text) or [1])
    ctx.off_loop = lambda raw, fn, *args: ServingContext.off_loop(ctx, raw, fn, *args)  # type: ignore[arg-type]

    def render(client: Client, prompt: str) -> asyncio.Future:
        req = CompletionRequest(model="m", prompt=prompt)
        return asyncio.ensure_future(render_completion(ctx, req, client.request()))  # type: ignore[arg-type]

    leaving = Client("b")
    waiting = render(leaving, "queued")
    await settle()
    assert queue.waiting == 1  # a render holds a place in the bounded queue
    with pytest.raises(ServiceUnavailableError):
        await render(Client("b"), "shed")
    leaving.left.set()
    with pytest.raises(ClientDisconnected):
        await waiting
    assert queue.waiting == 0
    staying = render(Client("c"), "served")
    gate.set()
    assert (await staying).body == b'[{"token_ids":[1]}]'
    assert encoded == ["served"]  # the render whose client left was never tokenized
