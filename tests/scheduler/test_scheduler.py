"""Scheduler unit tests with no model: admission, token budget, capacity, abort."""

from __future__ import annotations

import pytest

from scheduler.policy import SpecConfig
from scheduler.scheduler import QueueFullError, Scheduler, SchedulerConfig
from scheduler.types import (
    Batch,
    FinishReason,
    InvalidRequestError,
    Request,
    RowOutput,
    SamplingParams,
    StepOutput,
)

EOS = 99


def make(rid: str, prompt_len: int = 4, max_tokens: int = 4, **params) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, temperature=0, **params))


def fake_step(batch: Batch, token: int = 7, accept: int = 0) -> StepOutput:
    """What a runner would return: one token per sampling row (plus `accept` drafts)."""
    rows = []
    for row in batch.rows:
        if not row.sample:
            rows.append(RowOutput(row.request_id))
            continue
        k = min(accept, row.num_spec_tokens)
        rows.append(
            RowOutput(
                row.request_id,
                token_ids=[token] * (k + 1),
                num_draft_tokens=row.num_spec_tokens,
                num_accepted_tokens=k,
                method="ngram" if row.num_spec_tokens else None,
            )
        )
    return StepOutput(rows=rows)


def scheduler(**kw) -> Scheduler:
    defaults = dict(max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16, max_queue=4, eos_token_ids=[EOS])
    defaults.update(kw)
    return Scheduler(SchedulerConfig(**defaults), proposer="ngram")


def test_fifo_admission_and_slots():
    s = scheduler()
    for i in range(3):
        s.add(make(f"r{i}"))
    batch, _ = s.schedule()
    assert [r.request_id for r in batch.rows] == ["r0", "r1"]
    assert [r.slot for r in batch.rows] == [0, 1]
    assert all(r.sample and r.start_pos == 0 for r in batch.rows)
    assert [r.request_id for r in s.waiting] == ["r2"]  # no slot: waits


def test_token_budget_chunks_prefill():
    s = scheduler(max_num_batched_tokens=6)
    s.add(make("long", prompt_len=10))
    s.add(make("short", prompt_len=3))
    batch, _ = s.schedule()
    assert [(r.request_id, len(r.token_ids), r.sample) for r in batch.rows] == [("long", 6, False)]
    s.update(batch, fake_step(batch))
    batch, _ = s.schedule()
    # The rest of the long prompt (4), then the short one gets the remaining budget (2 of 3).
    assert [(r.request_id, r.start_pos, len(r.token_ids), r.sample) for r in batch.rows] == [
        ("long", 6, 4, True),
        ("short", 0, 2, False),
    ]
    s.update(batch, fake_step(batch))
    batch, _ = s.schedule()
    # Decode rows come first and always get their token.
    assert [(r.request_id, r.token_ids) for r in batch.rows] == [("long", [7]), ("short", [3])]


def test_capacity_wait_then_admit_after_finish():
    s = scheduler(max_num_seqs=1)
    s.add(make("a", max_tokens=2))
    s.add(make("b"))
    batch, _ = s.schedule()
    assert [r.request_id for r in batch.rows] == ["a"]
    s.update(batch, fake_step(batch))
    batch, _ = s.schedule()
    outs = s.update(batch, fake_step(batch))
    assert outs[0].finished and outs[0].finish_reason is FinishReason.LENGTH
    batch, _ = s.schedule()
    assert [r.request_id for r in batch.rows] == ["b"]
    assert batch.rows[0].slot == 0
    assert batch.finished_ids == ["a"]


def test_stop_token_and_max_tokens_cut_inside_accepted_run():
    s = scheduler()
    s.add(make("a", max_tokens=3, speculation=True, num_speculative_tokens=4))
    batch, _ = s.schedule()
    s.update(batch, fake_step(batch))
    batch, _ = s.schedule()
    assert batch.rows[0].num_spec_tokens == 1  # capped: only 2 tokens left, a step emits k + 1
    out = s.update(batch, fake_step(batch, accept=4))
    assert out[0].finished and out[0].finish_reason is FinishReason.LENGTH
    assert s.get("a") is None  # finished requests leave the scheduler

    s.add(make("b", max_tokens=10))
    batch, _ = s.schedule()
    out = s.update(batch, fake_step(batch, token=EOS))
    assert out[0].finish_reason is FinishReason.STOP and out[0].new_token_ids == [] and out[0].stop_token_id == EOS

    s.add(make("c", max_tokens=10, ignore_eos=True))
    batch, _ = s.schedule()
    out = s.update(batch, fake_step(batch, token=EOS))
    assert not out[0].finished and out[0].new_token_ids == [EOS]


def test_rollback_moves_num_computed_tokens():
    s = scheduler()
    s.add(make("a", max_tokens=20, speculation=True, num_speculative_tokens=3))
    batch, _ = s.schedule()
    s.update(batch, fake_step(batch))
    request = batch.rows[0].request
    assert request.num_computed_tokens == 4  # the prompt; the sampled token is fed next step
    batch, _ = s.schedule()
    row = batch.rows[0]
    assert row.start_pos == 4 and row.num_spec_tokens == 3
    s.update(batch, fake_step(batch, accept=1))
    # last token + 1 accepted draft are valid; the 2 rejected drafts are dropped.
    assert request.num_computed_tokens == 4 + 1 + 1
    assert request.num_prompt_tokens + len(request.output_ids) == request.num_computed_tokens + 1


def test_abort_waiting_and_running_frees_slot():
    s = scheduler(max_num_seqs=1)
    s.add(make("a", max_tokens=10))
    s.add(make("b"))
    batch, _ = s.schedule()
    s.update(batch, fake_step(batch))
    s.abort("a")
    s.abort("b")
    batch, aborted = s.schedule()
    assert {o.request_id for o in aborted} == {"a", "b"}
    assert all(o.finish_reason is FinishReason.ABORT for o in aborted)
    assert batch.rows == [] and batch.finished_ids == ["a"]
    assert s.kv_usage == 0 and not s.running and not s.waiting
    s.add(make("c"))
    batch, _ = s.schedule()
    assert batch.rows[0].slot == 0


def test_refusals_before_queueing():
    s = scheduler(max_model_len=16, max_queue=1)
    with pytest.raises(InvalidRequestError) as e:
        s.add(make("empty", prompt_len=0))
    assert e.value.param == "prompt"
    with pytest.raises(InvalidRequestError) as e:
        s.add(make("long", prompt_len=16))
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(InvalidRequestError) as e:
        s.add(make("toomany", prompt_len=10, max_tokens=7))
    assert e.value.param == "max_tokens"
    s.add(make("ok"))
    with pytest.raises(QueueFullError):
        s.add(make("full"))


def test_spec_threshold_makes_plain_steps():
    s = scheduler(max_num_seqs=4, spec=SpecConfig(num_speculative_tokens=3, spec_disable_batch_size=2))
    for i in range(3):
        s.add(make(f"r{i}", max_tokens=20))
    batch, _ = s.schedule()
    s.update(batch, fake_step(batch))
    batch, _ = s.schedule()
    assert len(batch.rows) == 3 and not any(r.num_spec_tokens for r in batch.rows)  # 3 > 2: nobody drafts
    s.abort("r2")
    s.update(batch, fake_step(batch))
    batch, _ = s.schedule()
    assert len(batch.rows) == 2 and all(r.num_spec_tokens > 0 for r in batch.rows)


def test_spec_threshold_counts_prefilling_requests():
    """The threshold compares running requests, as documented: a long prompt
    still prefilling counts, though it does not decode yet."""
    s = scheduler(
        max_num_seqs=4, max_num_batched_tokens=8, spec=SpecConfig(num_speculative_tokens=3, spec_disable_batch_size=2)
    )
    for i in range(2):
        s.add(make(f"r{i}", max_tokens=20))
    batch, _ = s.schedule()
    s.update(batch, fake_step(batch))
    batch, _ = s.schedule()
    assert all(r.num_spec_tokens > 0 for r in batch.rows)  # 2 running: at the threshold
    s.add(make("long", prompt_len=40, max_tokens=4))
    s.update(batch, fake_step(batch))
    batch, _ = s.schedule()
    decoding = [r for r in batch.rows if r.request_id != "long"]
    assert any(r.request_id == "long" and not r.sample for r in batch.rows)  # prefilling in chunks
    assert decoding and not any(r.num_spec_tokens for r in decoding)  # 3 running > 2


def test_forced_and_disabled_speculation():
    s = scheduler(max_num_seqs=3, spec=SpecConfig(num_speculative_tokens=3, spec_disable_batch_size=1))
    s.add(make("on", max_tokens=20, speculation=True))
    s.add(make("off", max_tokens=20, speculation=False))
    s.add(make("auto", max_tokens=20))
    batch, _ = s.schedule()
    s.update(batch, fake_step(batch))
    batch, _ = s.schedule()
    ks = {r.request_id: r.num_spec_tokens for r in batch.rows}
    assert ks == {"on": 3, "off": 0, "auto": 0}
