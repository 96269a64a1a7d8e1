"""StepRecorder: request timing and StepStats from published outputs, no model."""

from __future__ import annotations

import logging

import pytest

from scheduler.recorder import StepRecorder
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.types import (
    Batch,
    FinishReason,
    Request,
    RequestOutput,
    RowOutput,
    SamplingParams,
    ScheduledRow,
    StepOutput,
    StepStats,
)
from speculation.config import SpecConfig
from speculation.proposer import Drafting


@pytest.fixture
def recorded() -> tuple[StepRecorder, list[StepStats]]:
    seen: list[StepStats] = []
    return StepRecorder(Scheduler(SchedulerConfig(max_num_seqs=2, max_model_len=64)), seen.append), seen


def out(request_id: str, tokens: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id,
        tokens,
        finished=finished,
        finish_reason=FinishReason.LENGTH if finished else None,
        num_prompt_tokens=3,
        num_output_tokens=2,
    )


def test_first_token_is_timed_once_and_gaps_follow(recorded):
    recorder, seen = recorded
    recorder.arrived("a")
    request = Request("a", [1, 2, 3], SamplingParams(max_tokens=2, seed=0))
    batch = Batch(rows=[ScheduledRow(request, [1, 2, 3], 0, sample=True)])
    step = StepOutput(rows=[RowOutput("a", [7], method="ngram", num_draft_tokens=2, num_accepted_tokens=1)])
    recorder.published([out("a", [7])])
    recorder.step(batch, step, [out("a", [7])], 0.01)
    recorder.published([out("a", [8, 9], finished=True)])
    recorder.step(batch, StepOutput(rows=[RowOutput("a", [8, 9])]), [out("a", [8, 9], finished=True)], 0.02)

    first, second = seen
    assert len(first.first_token_latencies) == 1 and not first.token_gaps and first.mode == "spec"
    assert first.num_prompt_tokens == 3 and first.num_generation_tokens == 1
    assert second.first_token_latencies == [] and [n for n, _ in second.token_gaps] == [2]
    (done,) = second.finished
    assert done.finish_reason is FinishReason.LENGTH
    assert done.ttft_seconds == pytest.approx(first.first_token_latencies[0])  # one timestamp for both
    assert recorder.num_tracked == 0 and recorder.last_step_speculated is False
    assert recorder.acceptance()["acceptance_rate"] == 0.5


def test_idle_flushes_finishes_published_without_a_step(recorded):
    recorder, seen = recorded
    recorder.arrived("b")
    recorder.published([RequestOutput("b", [], finished=True, finish_reason=FinishReason.ABORT)])
    recorder.idle()
    (stats,) = seen
    assert stats.batch_size == 0 and stats.step_seconds == 0.0 and stats.mode == "plain"
    assert [f.finish_reason for f in stats.finished] == [FinishReason.ABORT] and stats.finished[0].ttft_seconds is None
    assert recorder.num_tracked == 0


def test_an_observer_fault_is_contained(recorded, caplog):
    recorder, seen = recorded
    working = recorder.observer

    def broken(stats: StepStats) -> None:
        raise ValueError("observer bug")

    recorder.observer = broken
    with caplog.at_level(logging.ERROR, logger="specd.engine"):
        recorder.idle()  # logs, does not raise
    (record,) = [r for r in caplog.records if r.name == "specd.engine"]
    assert "the step observer failed" in record.getMessage()
    assert record.exc_info is not None and isinstance(record.exc_info[1], ValueError)
    # The recorder keeps working: the next report reaches a restored observer.
    recorder.observer = working
    recorder.arrived("c")
    recorder.published([RequestOutput("c", [], finished=True, finish_reason=FinishReason.ABORT)])
    recorder.idle()
    (stats,) = seen
    assert [f.finish_reason for f in stats.finished] == [FinishReason.ABORT]


def test_the_probes_a_step_graded_are_reported_by_proposer():
    """The scheduler grades probes into the step's plan as it applies the step; the recorder
    reports them from the plan it is handed, never from the policy's running totals."""
    seen: list[StepStats] = []
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=2, max_model_len=64), Drafting("eagle"))
    recorder = StepRecorder(scheduler, seen.append)
    for rid in ("a", "b"):
        scheduler.add(Request(rid, [1, 2, 3], SamplingParams(max_tokens=8, seed=0, ignore_eos=True)))
    batch, _ = scheduler.schedule()  # the prefills
    prefill = StepOutput(rows=[RowOutput("a", [5]), RowOutput("b", [5])])
    scheduler.update(batch, prefill, 0.01)
    recorder.step(batch, prefill, [], 0.01, scheduler.last_plan)
    batch, _ = scheduler.schedule()
    plan = scheduler.last_plan
    assert plan is not None and len(batch.rows) == 2
    probed = StepOutput(rows=[RowOutput("a", [5], probe_id=5), RowOutput("b", [5], probe_id=6, probe_accept=0.25)])
    scheduler.update(batch, probed, 0.01)
    recorder.step(batch, probed, [], 0.01, plan)
    assert seen[0].probes == {}
    assert seen[1].plan is plan and seen[1].probes == {"eagle": (2, pytest.approx(1.25))}


def test_a_plain_step_reports_why_its_auto_rows_did_not_draft():
    seen: list[StepStats] = []
    config = SchedulerConfig(max_num_seqs=2, max_model_len=64, spec=SpecConfig(spec_disable_batch_size=0))
    scheduler = Scheduler(config, Drafting("ngram"))
    recorder = StepRecorder(scheduler, seen.append)
    scheduler.add(Request("a", [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True)))
    for _ in range(2):  # the prefill, then a decode step whose auto row the operator's cap holds back
        batch, _ = scheduler.schedule()
        output = StepOutput(rows=[RowOutput("a", [5])])
        scheduler.update(batch, output, 0.01)
        recorder.step(batch, output, [], 0.01, scheduler.last_plan)
    assert [stats.plan.plain_reason if stats.plan else None for stats in seen] == [None, "cap"]
