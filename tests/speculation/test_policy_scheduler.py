"""Speculation policy through the scheduler, with a fake runner: accepting rows draft at
every batch size, the operator's cap holds exactly, and a policy fault runs the step plain."""

from __future__ import annotations

from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.types import Batch, Request, RowOutput, SamplingParams, StepOutput
from speculation.config import SpecConfig
from speculation.proposer import Drafting

COPY, CREATIVE = 7, 8


def fake_step(batch: Batch) -> StepOutput:
    """ "copy" rows accept every draft and emit what their shadows predicted;
    "creative" rows accept nothing and never match a shadow."""
    rows = []
    for row in batch.rows:
        copy = row.request_id.startswith("copy")
        if not row.sample:
            rows.append(RowOutput(row.request_id))
            continue
        k = row.num_spec_tokens if copy else 0
        shadow = ([COPY] if copy else [CREATIVE + 1]) * row.num_shadow_tokens or None
        token = COPY if copy else CREATIVE
        method = "ngram" if row.num_spec_tokens else None
        out = RowOutput(row.request_id, [token] * (k + 1), num_draft_tokens=row.num_spec_tokens, num_accepted_tokens=k)
        out.method, out.shadow_ids = method, shadow
        rows.append(out)
    return StepOutput(rows=rows)


def step_seconds(batch: Batch, output: StepOutput) -> float:
    """A memory-bound step: 50 ms plus 1 ms per token fed."""
    tokens = sum(len(r.token_ids) for r in batch.rows) + sum(o.num_draft_tokens for o in output.rows)
    return 0.050 + 0.001 * tokens


def test_accepting_rows_draft_and_the_others_do_not_at_every_batch_size():
    for size in (2, 4, 8, 16):
        config = SchedulerConfig(max_num_seqs=size, max_model_len=4096, max_num_batched_tokens=1024,
                                 spec=SpecConfig(num_speculative_tokens=8))  # fmt: skip
        s = Scheduler(config, Drafting("ngram"))
        for i in range(size):
            kind = "copy" if i % 2 == 0 else "creative"
            s.add(Request(f"{kind}{i}", [1, 2, 3], SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)))
        for _ in range(60):
            batch, _ = s.schedule()
            output = fake_step(batch)
            s.update(batch, output, step_seconds(batch, output))
        ks = {row.request_id: row.num_spec_tokens for row in s.schedule()[0].rows}
        assert all(k >= 4 for rid, k in ks.items() if rid.startswith("copy")), (size, ks)  # long drafts
        assert all(k == 0 for rid, k in ks.items() if rid.startswith("creative")), (size, ks)
        plan = s.last_plan
        assert plan is not None and plan.predicted_seconds is not None


def test_the_operators_cap_is_obeyed_exactly():
    config = SchedulerConfig(max_num_seqs=8, max_model_len=4096, max_num_batched_tokens=1024,
                             spec=SpecConfig(num_speculative_tokens=4, spec_disable_batch_size=3))  # fmt: skip
    s = Scheduler(config, Drafting("ngram"))
    for i in range(5):
        s.add(Request(f"copy{i}", [1, 2, 3], SamplingParams(max_tokens=3000, temperature=0, ignore_eos=True)))
    s.add(Request("forced", [1, 2, 3], SamplingParams(max_tokens=3000, ignore_eos=True, speculation=True)))
    for _ in range(10):  # 6 running > 3: auto rows never draft, the forced row always does
        batch, _ = s.schedule()
        ks = {r.request_id: r.num_spec_tokens for r in batch.rows}
        if all(r.request.output_ids for r in batch.rows):
            assert ks.pop("forced") == 4 and set(ks.values()) == {0}
        output = fake_step(batch)
        s.update(batch, output, step_seconds(batch, output))
    for rid in ("copy3", "copy4", "forced"):
        s.abort(rid)
    for _ in range(10):  # 3 running: at the cap, the copy rows draft
        batch, _ = s.schedule()
        output = fake_step(batch)
        s.update(batch, output, step_seconds(batch, output))
    assert len(batch.rows) == 3 and all(r.num_spec_tokens == 4 for r in batch.rows)


def test_a_policy_fault_runs_the_step_plain_instead_of_stopping_the_engine():
    config = SchedulerConfig(max_num_seqs=4, max_model_len=4096, max_num_batched_tokens=1024,
                             spec=SpecConfig(num_speculative_tokens=4))  # fmt: skip
    s = Scheduler(config, Drafting("ngram"))
    requests = [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=20, temperature=0, speculation=True))
                for i in range(2)]  # fmt: skip
    for r in requests:
        s.add(r)

    def broken(*args, **kwargs):
        raise ZeroDivisionError("float division by zero")

    s.policy.decide = broken
    for _ in range(3):
        batch, _ = s.schedule()
        assert len(batch.rows) == 2 and all(r.num_spec_tokens == 0 for r in batch.rows)
        output = fake_step(batch)
        s.update(batch, output, step_seconds(batch, output))
    assert all(len(r.output_ids) == 3 for r in requests)  # a prefill, then two plain decode steps


def test_the_policy_learns_the_length_of_requests_that_end_on_their_own():
    """A finished request tells the policy its output length (the catch-up charge's horizon);
    an aborted one does not."""
    config = SchedulerConfig(max_num_seqs=4, max_model_len=4096, max_num_batched_tokens=1024,
                             spec=SpecConfig(num_speculative_tokens=4))  # fmt: skip
    s = Scheduler(config, Drafting("ngram"))
    for i in range(3):
        s.add(Request(f"copy{i}", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)))
    s.add(Request("creative-aborted", [1, 2, 3], SamplingParams(max_tokens=500, temperature=0, ignore_eos=True)))
    for _ in range(3):
        batch, _ = s.schedule()
        output = fake_step(batch)
        s.update(batch, output, step_seconds(batch, output))
    s.abort("creative-aborted")
    while s.has_work:
        batch, _ = s.schedule()
        if batch.rows:
            output = fake_step(batch)
            s.update(batch, output, step_seconds(batch, output))
    assert s.policy.mean_output_tokens == 5


def test_a_draft_that_ends_early_teaches_the_policy_how_far_drafts_run():
    """A draft model whose drafts end after their first token (as one that doubts the next does on
    a CPU): the scheduler grades every verify against the length it asked for, so the policy
    learns that the later positions are seldom drafted (`DraftReach`), whatever it planned."""
    config = SchedulerConfig(max_num_seqs=2, max_model_len=4096, spec=SpecConfig(num_speculative_tokens=4))
    s = Scheduler(config, Drafting("draft_model"))
    s.add(Request("a", [1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True, speculation=True)))
    asked = []
    for _ in range(40):
        batch, _ = s.schedule()
        rows = []
        for row in batch.rows:
            if row.num_spec_tokens:
                asked.append(row.num_spec_tokens)
            drafted = min(row.num_spec_tokens, 1)
            out = RowOutput(row.request_id, [COPY] * (drafted + 1) if row.sample else [],
                            num_draft_tokens=drafted, num_accepted_tokens=drafted)  # fmt: skip
            out.method = "draft_model" if drafted else None
            rows.append(out)
        s.update(batch, StepOutput(rows=rows), 0.05)
    assert asked and set(asked) == {4}
    first, *later = s.policy.reach.of(4)
    assert first == 1.0
    assert all(r < 0.1 for r in later)
