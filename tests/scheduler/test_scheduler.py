"""Scheduler unit tests with no model: admission, token budget, capacity, abort."""

from __future__ import annotations

import pytest

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
from speculation.config import SpecConfig
from speculation.proposer import Drafting

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
    return Scheduler(SchedulerConfig(**defaults), Drafting("ngram"))


def test_fifo_admission_up_to_max_num_seqs():
    s = scheduler()
    for i in range(3):
        s.add(make(f"r{i}"))
    batch, _ = s.schedule()
    assert [r.request_id for r in batch.rows] == ["r0", "r1"]
    assert [r.block_ids for r in batch.rows] == [[0], [1]]  # a 4-token prompt fills part of one block
    assert all(r.sample and r.start_pos == 0 for r in batch.rows)
    assert [r.request_id for r in s.waiting] == ["r2"]  # max_num_seqs running: waits


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
    assert s.blocks.num_used == 1  # a's block went back to the pool
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


def test_abort_waiting_and_running_frees_blocks():
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
    assert [r.request_id for r in batch.rows] == ["c"] and s.blocks.num_used == 1


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


# -- paged KV: admission by blocks, prefix cache hits, preemption --


def run_to_end(s: Scheduler, token: int = 7) -> None:
    for _ in range(200):
        if not s.has_work:
            return
        batch, _ = s.schedule()
        s.update(batch, fake_step(batch, token))
    raise AssertionError("requests did not finish")


def paged(**kw) -> Scheduler:
    return scheduler(**({"block_size": 4, "max_model_len": 64, "max_num_batched_tokens": 64} | kw))


def test_a_shared_prefix_is_reused_in_whole_blocks_and_reported():
    s = paged()
    prefix = list(range(1, 11))  # 10 tokens: two full blocks of 4, then 2
    a = Request("a", prefix + [50, 51], SamplingParams(max_tokens=3, temperature=0))
    s.add(a)
    run_to_end(s)
    b = Request("b", prefix + [60], SamplingParams(max_tokens=3, temperature=0))
    s.add(b)
    batch, _ = s.schedule()
    (row,) = batch.rows
    assert row.start_pos == 8 and row.token_ids == [9, 10, 60]  # only the uncached tail is computed
    assert b.num_cached_tokens == 8 and s.blocks.stats.hits == 8
    outs = s.update(batch, fake_step(batch))
    assert outs[0].num_cached_tokens == 8


def test_a_fully_cached_prompt_still_computes_its_last_block():
    s = paged()
    prompt = list(range(1, 9))  # exactly two blocks
    s.add(Request("a", prompt, SamplingParams(max_tokens=2, temperature=0)))
    run_to_end(s)
    b = Request("b", list(prompt), SamplingParams(max_tokens=2, temperature=0))
    s.add(b)
    batch, _ = s.schedule()
    # The last token's logits are needed, and a hit never shares a block it would write.
    assert batch.rows[0].start_pos == 4 and b.num_cached_tokens == 4
    assert b.block_ids[1] != batch.rows[0].block_ids[0]


def test_tenants_never_share_cached_blocks():
    s = paged()
    prompt = list(range(1, 13))
    s.add(Request("a", prompt, SamplingParams(max_tokens=2, temperature=0), tenant="team-a"))
    run_to_end(s)
    other = Request("b", list(prompt), SamplingParams(max_tokens=2, temperature=0), tenant="team-b")
    same = Request("c", list(prompt), SamplingParams(max_tokens=2, temperature=0), tenant="team-a")
    s.add(other)
    s.schedule()
    assert other.num_cached_tokens == 0
    s.add(same)
    s.schedule()
    assert same.num_cached_tokens == 8


def test_prefix_caching_off_never_hits():
    s = paged(prefix_caching=False)
    prompt = list(range(1, 13))
    s.add(Request("a", prompt, SamplingParams(max_tokens=2, temperature=0)))
    run_to_end(s)
    b = Request("b", list(prompt), SamplingParams(max_tokens=2, temperature=0))
    s.add(b)
    s.schedule()
    assert b.num_cached_tokens == 0 and s.blocks.num_cached == 0


def test_admission_waits_for_blocks_not_just_for_a_seat():
    s = paged(max_num_seqs=4, num_kv_blocks=5)  # 20 positions
    s.add(make("a", prompt_len=12, max_tokens=4))  # 3 blocks for its prompt
    s.add(make("b", prompt_len=10, max_tokens=4))  # 3 more: does not fit beside a
    batch, _ = s.schedule()
    assert [r.request_id for r in batch.rows] == ["a"] and [r.request_id for r in s.waiting] == ["b"]
    run_to_end(s)
    assert s.blocks.num_used == 0


def test_the_newest_request_is_preempted_when_decoding_runs_out_of_blocks():
    s = paged(max_num_seqs=2, num_kv_blocks=4)  # 16 positions for two requests of 4 + 8 tokens
    a, b = make("a", prompt_len=4, max_tokens=8), make("b", prompt_len=4, max_tokens=8)
    s.add(a)
    s.add(b)
    preempted_at = None
    for step in range(40):
        batch, _ = s.schedule()
        if b.num_preemptions and preempted_at is None:
            preempted_at = step
            assert b.status.value == "waiting" and s.waiting[0] is b and b.block_ids == []
            assert b.request_id in batch.finished_ids  # the runner drops its state
            assert s.queue_state().num_preempted == 1
        s.update(batch, fake_step(batch))
        if not s.has_work:
            break
    assert preempted_at is not None and a.num_preemptions == 0
    assert s.num_preemptions >= 1
    assert len(a.output_ids) == len(b.output_ids) == 8  # nothing lost: b recomputed and finished
    assert s.blocks.num_used == 0


def test_a_preempted_request_recomputes_prompt_and_output_but_the_last_token():
    s = paged(max_num_seqs=1, prefix_caching=False)
    r = make("r", prompt_len=6, max_tokens=8)
    s.add(r)
    for _ in range(4):
        batch, _ = s.schedule()
        s.update(batch, fake_step(batch))
    s._preempt(r)
    assert r.num_prefill_tokens == r.num_tokens - 1 and r.is_prefilling
    batch, _ = s.schedule()
    (row,) = batch.rows
    assert row.start_pos == 0 and row.token_ids == r.all_token_ids[:-1] and not row.sample
    s.update(batch, fake_step(batch))
    batch, _ = s.schedule()
    assert batch.rows[0].token_ids == [r.output_ids[-1]] and batch.rows[0].sample


def test_drafts_are_trimmed_to_the_blocks_left_never_preempting():
    s = paged(max_num_seqs=2, num_kv_blocks=3)
    r = make("r", prompt_len=7, max_tokens=5, speculation=True, num_speculative_tokens=4)
    s.add(r)
    batch, _ = s.schedule()
    s.update(batch, fake_step(batch))
    other = make("o", prompt_len=4, max_tokens=1)
    s.add(other)
    batch, _ = s.schedule()  # r decodes at position 7 (block 2 of 2 is full after it); o takes the last block
    spec_row = next(row for row in batch.rows if row.request_id == "r")
    assert spec_row.num_spec_tokens == 0 and s.num_preemptions == 0


def test_a_request_larger_than_the_pool_is_refused_naming_it():
    s = paged(num_kv_blocks=3)  # 12 positions, though max_model_len is 64
    with pytest.raises(InvalidRequestError, match=r"the KV cache \(3 blocks of 4\) holds 12 tokens") as e:
        s.add(make("big", prompt_len=8, max_tokens=8))
    assert e.value.param == "max_tokens" and e.value.code == "context_length_exceeded"
