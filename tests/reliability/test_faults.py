"""Faults: an exception in the engine step and a NaN in one row's logits fail only
their own request (500, or an error event then [DONE] in a stream) while the
requests batched with them finish exactly and the engine keeps serving; an
unattributed step failure is narrowed down to its request; a failing draft
model costs speed, never a request (the step decodes plainly)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from models.loader import ModelConfig, load_model
from scheduler.offline import run_offline
from scheduler.scheduler import SchedulerConfig
from scheduler.types import FinishReason, Request, SamplingParams
from speculation.config import ProposerConfig, SpecConfig
from tests.reliability.rel_harness import CYCLE_NAME, leaked_bookkeeping, sse_events, stream_text
from tests.support.cycle import CYCLE_TEXT
from worker.builder import build_runner
from worker.runner import RunnerConfig

# -- over HTTP: the test-only `fault` field -----------------------------------------------

NORMALS = [  # (prompt, speculation): running when the faults arrive
    ("\nAb", False),
    (CYCLE_TEXT * 4, True),
    (CYCLE_TEXT, "auto"),
]
NORMAL_TOKENS = 400  # prompt + 400 < 512 positions; the speculating one still takes ~80 steps
FAULTS = [  # (path, fault, stream, speculation)
    ("/completions", "raise", False, "auto"),
    ("/chat/completions", "nan", False, False),
    ("/chat/completions", "raise", True, True),
    ("/completions", "nan", True, "auto"),
    ("/completions", "nan", False, True),  # NaN in a verify row (drafts on a repetitive prompt)
]


def fault_body(path: str, fault: str, stream: bool, speculation) -> dict:
    body = {"model": CYCLE_NAME, "max_tokens": 60, "stream": stream, "speculation": speculation, "fault": fault}
    if path == "/completions":
        body["prompt"] = CYCLE_TEXT * 4
    else:
        body["messages"] = [{"role": "user", "content": CYCLE_TEXT * 3}]
    return body


@pytest.mark.slow
async def test_faults_fail_only_their_request(chaos_server, cycle_text, tally):
    server = chaos_server
    before = server.wait_idle()
    async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=300) as http:
        started = [asyncio.Event() for _ in NORMALS]
        finished_at: list[float] = [0.0] * len(NORMALS)

        async def normal(i: int) -> tuple[str, list[str], list[dict]]:
            prompt, speculation = NORMALS[i]
            body = {
                "model": CYCLE_NAME,
                "prompt": prompt,
                "max_tokens": NORMAL_TOKENS,
                "stream": True,
                "speculation": speculation,
            }
            events = []
            async with http.stream("POST", "/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line[len("data: ") :])
                        started[i].set()
            finished_at[i] = time.monotonic()
            return stream_text(events)

        normals = [asyncio.create_task(normal(i)) for i in range(len(NORMALS))]
        await asyncio.wait_for(asyncio.gather(*(event.wait() for event in started)), timeout=120)
        faults = await asyncio.gather(*(http.post(path, json=fault_body(path, *rest)) for path, *rest in FAULTS))
        faults_done = time.monotonic()
        normal_results = await asyncio.gather(*normals)
    tally.faults_injected += len(FAULTS)

    for (_path, _fault, stream, _), response in zip(FAULTS, faults):
        if stream:
            assert response.status_code == 200  # the headers went out before the fault
            events = sse_events(response.text)
            assert events[-1] == "[DONE]", events
            error = json.loads(events[-2])["error"]
            _, finishes, errors = stream_text(events)
            assert errors == [error] and finishes == []
        else:
            assert response.status_code == 500, response.text
            error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "server_error" and error["code"] == "engine_error"
        assert "Traceback" not in error["message"]
    # The normals were still running when every fault had come back: they shared its batches.
    assert faults_done < min(finished_at)
    lost = 0
    for (prompt, _), (text, finishes, errors) in zip(NORMALS, normal_results):
        lost += not (finishes == ["length"] and not errors and text == cycle_text.expected(prompt, NORMAL_TOKENS))
    tally.requests_lost += lost
    assert lost == 0

    after = server.wait_idle()
    errors_counted = after.value("specd_requests_total", finish_reason="error") - before.value(
        "specd_requests_total", finish_reason="error"
    )
    assert errors_counted == len(FAULTS)
    assert after.value("specd_kv_cache_usage_ratio") == 0
    probe = server.probe()
    assert probe["engine_running"] and leaked_bookkeeping(probe) == {}
    assert httpx.get(server.url + "/ready", timeout=10).status_code == 200
    fresh = {"model": CYCLE_NAME, "prompt": "\n", "max_tokens": 12}
    reply = httpx.post(server.base_url + "/completions", headers=server.headers, timeout=60, json=fresh)
    assert reply.json()["choices"][0]["text"] == cycle_text.expected("\n", 12)


# -- in-process: the engine and the runner -------------------------------------------------

PROMPTS = [
    "Hello world! How are you",
    "def add(a, b):\n    return",
    "A B C D E F G A B C D E F G",
    "for i in range(10):\n",
]


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return load_model(ModelConfig(str(tiny_llama_dir), dtype="float32", device="cpu"))


def engine_config(target, **spec) -> SchedulerConfig:
    return SchedulerConfig(
        max_num_seqs=4,
        max_model_len=256,
        max_num_batched_tokens=256,
        eos_token_ids=target.eos_token_ids,
        spec=SpecConfig(num_speculative_tokens=4, **spec),
    )


def requests_for(target, tag: str, speculation, **params) -> list[Request]:
    params = {"max_tokens": 32, "temperature": 0, "ignore_eos": True, **params}
    return [
        Request(f"{tag}{i}", target.tokenizer(p).input_ids, SamplingParams(speculation=speculation, **params))
        for i, p in enumerate(PROMPTS)
    ]


class FailingAfterExecute:
    """An executor whose step fails *after* the forward (KV written) whenever `culprit` is in the batch,
    with a plain exception that names no request: the engine must find the culprit itself."""

    def __init__(self, runner, culprit: str):
        self.runner = runner
        self.culprit = culprit
        self.drafting = runner.drafting
        self.num_raised = 0

    def execute(self, batch):
        output = self.runner.execute(batch)
        if any(row.request_id == self.culprit for row in batch.rows):
            self.num_raised += 1
            raise RuntimeError("simulated kernel failure")
        return output


def test_unattributed_step_failure_fails_only_the_culprit(target, tally):
    runner = build_runner(target, RunnerConfig(max_num_seqs=4, max_model_len=256), ProposerConfig("ngram"))
    config = engine_config(target)
    plain = run_offline(runner, config, requests_for(target, "plain", False))
    flaky = FailingAfterExecute(runner, culprit="mixed1")
    mixed = run_offline(flaky, config, requests_for(target, "mixed", "auto"))
    tally.faults_injected += 1
    assert flaky.num_raised >= 1
    assert mixed[1].finish_reason is FinishReason.ERROR and "simulated" in mixed[1].error
    for i in (0, 2, 3):
        assert mixed[i].finish_reason is FinishReason.LENGTH and mixed[i].token_ids == plain[i].token_ids


@pytest.mark.parametrize("fail_every", [1, 3], ids=["draft-always-fails", "draft-fails-every-third-forward"])
def test_draft_model_failure_falls_back_to_plain_decoding(target, tiny_llama_dir, monkeypatch, tally, fail_every):
    """The draft is the target itself (every draft accepted when it works); its forward fails
    mid-draft. Greedy output equals plain decoding token for token and no request fails."""
    import speculation.draft_model as draft_model

    runner = build_runner(
        target, RunnerConfig(max_num_seqs=4, max_model_len=256), ProposerConfig("draft_model", str(tiny_llama_dir))
    )
    config = engine_config(target)
    plain = run_offline(runner, config, requests_for(target, "plain", False))
    real_forward = draft_model.forward_step
    calls = {"n": 0, "raised": 0}

    def failing_forward(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] % fail_every == 0:
            calls["raised"] += 1
            raise RuntimeError("draft model exploded")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(draft_model, "forward_step", failing_forward)
    spec = run_offline(runner, config, requests_for(target, "spec", True))
    tally.faults_injected += calls["raised"]
    assert calls["raised"] > 0
    assert [c.finish_reason for c in spec] == [FinishReason.LENGTH] * len(PROMPTS)
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    num_drafted = sum(c.num_draft_tokens for c in spec)
    if fail_every == 1:
        assert num_drafted == 0  # every step fell back to plain decoding
    else:
        assert num_drafted > 0  # drafting resumed between failures


def test_failed_drafts_leave_sampled_output_as_plain(target, tiny_llama_dir, monkeypatch, tally):
    """With every draft failing, a seeded sampled request emits exactly what plain decoding emits."""
    import speculation.draft_model as draft_model

    runner = build_runner(
        target, RunnerConfig(max_num_seqs=4, max_model_len=256), ProposerConfig("draft_model", str(tiny_llama_dir))
    )
    config = engine_config(target)
    params = {"temperature": 0.8, "top_p": 0.95, "seed": 1234}
    plain = run_offline(runner, config, requests_for(target, "plain", False, **params))

    def broken(*args, **kwargs):
        raise RuntimeError("draft model exploded")

    monkeypatch.setattr(draft_model, "forward_step", broken)
    spec = run_offline(runner, config, requests_for(target, "spec", True, **params))
    tally.faults_injected += 1
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert all(c.finish_reason is FinishReason.LENGTH and c.num_draft_tokens == 0 for c in spec)


async def test_an_abort_in_a_failing_step_is_still_accounted(target):
    """Found by the soak: a client that leaves just as a faulty request's step fails must
    still be recorded as finished (abort), and leave no per-request state behind."""
    from scheduler.engine import AsyncEngine

    runner = build_runner(
        target, RunnerConfig(max_num_seqs=4, max_model_len=256, enable_fault_injection=True), ProposerConfig("ngram")
    )
    finished = []
    engine = AsyncEngine(runner, engine_config(target), observer=lambda stats: finished.extend(stats.finished))
    await engine.start()
    try:
        prompt = target.tokenizer("Hello world").input_ids
        leaving = engine.submit(
            Request("leaving", prompt, SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
        )
        async for out in leaving:
            if out.new_token_ids:
                break
        leaving.abort()  # the abort and the faulty request reach the same schedule()
        faulty = engine.submit(Request("faulty", prompt, SamplingParams(max_tokens=8, fault="raise")))
        outs = [out async for out in faulty]
        rest = [out async for out in leaving]
        assert outs[-1].finish_reason is FinishReason.ERROR and rest[-1].finish_reason is FinishReason.ABORT
        for _ in range(100):
            if not engine.scheduler.has_work:
                break
            await asyncio.sleep(0.01)
        assert sorted(f.finish_reason.value for f in finished) == ["abort", "error"]
        assert engine.recorder.num_tracked == 0 and engine._streams == {}
    finally:
        await engine.stop(timeout=1)


async def test_a_request_that_finishes_in_a_one_row_rerun_is_accounted(target):
    """An unattributed failure re-runs rows one by one; a request that completes in its
    re-run is recorded as finished like any other (no stale per-request state)."""
    from scheduler.engine import AsyncEngine

    runner = build_runner(target, RunnerConfig(max_num_seqs=4, max_model_len=256), ProposerConfig("ngram"))
    flaky = FailingAfterExecute(runner, culprit="culprit")
    finished = []
    engine = AsyncEngine(flaky, engine_config(target), observer=lambda stats: finished.extend(stats.finished))
    await engine.start()
    try:
        prompt = target.tokenizer("Hello world").input_ids
        short = engine.submit(Request("short", prompt, SamplingParams(max_tokens=1, temperature=0)))
        culprit = engine.submit(Request("culprit", prompt, SamplingParams(max_tokens=4, temperature=0)))
        short_outs = [out async for out in short]
        culprit_outs = [out async for out in culprit]
        assert flaky.num_raised >= 1
        assert short_outs[-1].finish_reason is FinishReason.LENGTH and short_outs[-1].num_output_tokens == 1
        assert culprit_outs[-1].finish_reason is FinishReason.ERROR
        assert sorted(f.finish_reason.value for f in finished) == ["error", "length"]
        assert engine.recorder.num_tracked == 0 and engine._streams == {}
    finally:
        await engine.stop(timeout=1)
