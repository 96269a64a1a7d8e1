"""The runner's step: draft-model batches with ragged k and mixed greedy/sampled
rows, draft KV after rejections, and the host-transfer budget of a step."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from models.kv_cache import KVCache
from models.linear_kernels import linear_params
from models.loader import ModelConfig, load_model
from models.transfer import TransferCounter
from scheduler.offline import run_offline
from scheduler.scheduler import SchedulerConfig
from scheduler.types import Batch, Request, RequestStatus, SamplingParams, ScheduledRow, StepOutput
from speculation import device_draft
from speculation.config import ProposerConfig, SpecConfig
from tests.support.tensors import packed_forward, read_kv, slot_table
from worker.builder import build_runner
from worker.runner import ModelRunner, RunnerConfig

PROMPTS = ["Hello world! How are you", "def add(a, b):\n    return", "A B C D E F G", "for i in range(10):\n"]


def make_runner(
    model_dir: Path, method: str = "ngram", draft: Path | None = None, stop_confidence: float = 0.0
) -> ModelRunner:
    """`draft`: the draft model's directory, or with method eagle the head's. A device proposer
    drafts every row's k unless `stop_confidence` ends drafts early (`DeviceProposer.run`)."""
    target = load_model(ModelConfig(str(model_dir), dtype="float32", device="cpu"))
    if method == "eagle":
        proposer = ProposerConfig(method, draft_head=str(draft), stop_confidence=stop_confidence)
    else:
        proposer = ProposerConfig(method, str(draft) if draft else None, stop_confidence=stop_confidence)
    return build_runner(target, RunnerConfig(max_num_seqs=SLOTS, max_model_len=MAX_LEN, block_size=BLOCK), proposer)


SLOTS, MAX_LEN, BLOCK = 4, 256, 16  # make_runner's pool: 4 x 256 positions in blocks of 16


def running(rid: str, prompt: list[int], slot: int, **params) -> Request:
    """A running request holding the blocks of sequence `slot` of the pool (scattered blocks)."""
    params.setdefault("temperature", 0)
    request = Request(rid, prompt, SamplingParams(max_tokens=64, ignore_eos=True, **params))
    request.status, request.block_ids = RequestStatus.RUNNING, slot_table(slot, SLOTS, MAX_LEN // BLOCK)
    return request


def step_output(runner: ModelRunner, requests: list[Request], k: list[int]) -> StepOutput:
    """One step for requests past their prompt (or prefilling it whole), applied as the scheduler would."""
    rows = []
    for request, ki in zip(requests, k):
        if request.num_computed_tokens < len(request.prompt_ids):
            rows.append(ScheduledRow(request, request.prompt_ids, 0, sample=True))
        else:
            rows.append(ScheduledRow(request, [request.output_ids[-1]], request.num_computed_tokens, True, ki))
    out = runner.execute(Batch(rows=rows))
    for row, row_out in zip(rows, out.rows):
        assert row_out.error is None
        row.request.num_computed_tokens = row.start_pos + len(row.token_ids) + row_out.num_accepted_tokens
        row.request.output_ids += row_out.token_ids
        row.request.draft = row_out.next_draft
    return out


def step(runner: ModelRunner, requests: list[Request], k: list[int]) -> list:
    """`step_output`'s rows."""
    return step_output(runner, requests, k).rows


def test_draft_model_mixed_greedy_and_sampled_rows_with_ragged_k(tiny_llama_dir, tiny_draft_dir, caplog):
    """Greedy and sampled rows drafting different k in one batch: no step fails
    (the engine never re-runs rows alone), and greedy rows equal plain decoding."""
    runner = make_runner(tiny_llama_dir, "draft_model", tiny_draft_dir)
    tok = runner.target.tokenizer
    config = SchedulerConfig(
        max_num_seqs=4, max_model_len=256, max_num_batched_tokens=256, spec=SpecConfig(num_speculative_tokens=4)
    )

    def requests(tag: str, speculation) -> list[Request]:
        out = []
        for i, prompt in enumerate(PROMPTS):
            sampled = i % 2 == 1
            out.append(
                Request(
                    f"{tag}{i}",
                    tok(prompt).input_ids,
                    SamplingParams(
                        max_tokens=24,
                        temperature=0.8 if sampled else 0,
                        seed=i,
                        ignore_eos=True,
                        speculation=speculation,
                        num_speculative_tokens=[2, 4, 3, 1][i],
                    ),
                )
            )
        return out

    with caplog.at_level(logging.ERROR):
        spec = run_offline(runner, config, requests("s", True))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
    plain = run_offline(runner, config, requests("p", False))
    for i in (0, 2):
        assert spec[i].token_ids == plain[i].token_ids
    assert all(c.num_draft_tokens > 0 for c in spec)
    # And one step by hand, so the shape is exactly the one that used to fail.
    reqs = [
        running(f"h{i}", tok(p).input_ids, i, temperature=0.8 if i % 2 else 0, seed=i) for i, p in enumerate(PROMPTS)
    ]
    step(runner, reqs, [0] * 4)
    rows = step(runner, reqs, [3, 2, 1, 4])
    assert [r.num_draft_tokens for r in rows] == [3, 2, 1, 4]


def _draft_kv_matches_fresh_prefill(runner: ModelRunner, request: Request) -> None:
    proposer = runner.proposer
    n = proposer._computed[request.request_id]
    assert n >= len(request.prompt_ids)
    draft = proposer.draft.model
    fresh = KVCache.for_model(draft.config, MAX_LEN // BLOCK, BLOCK, torch.float32, torch.device("cpu"))
    tokens = request.all_token_ids[:n]
    consecutive = list(range(MAX_LEN // BLOCK))
    packed_forward(draft, fresh, [consecutive], [0], [tokens], [n - 1])
    for layer in range(len(fresh.keys)):
        for ours, expected in zip(
            read_kv(proposer.cache, layer, request.block_ids, n), read_kv(fresh, layer, consecutive, n)
        ):
            torch.testing.assert_close(ours, expected, atol=1e-5, rtol=0)


def test_draft_kv_after_rejections_and_plain_steps_equals_a_fresh_prefill(tiny_llama_dir, tiny_draft_dir):
    """Verify rejects drafts, the row runs plain steps, then drafts again: the draft
    model's KV must hold only accepted tokens, not the rejected drafts."""
    runner = make_runner(tiny_llama_dir, "draft_model", tiny_draft_dir)
    request = running("r", runner.target.tokenizer(PROMPTS[1]).input_ids, slot=2)
    step(runner, [request], [0])  # prefill
    (first,) = step(runner, [request], [4])
    assert first.num_accepted_tokens < 4  # the 1-layer draft is rejected somewhere: stale positions exist
    for _ in range(3):
        step(runner, [request], [0])
    step(runner, [request], [3])
    _draft_kv_matches_fresh_prefill(runner, request)


@pytest.mark.parametrize(
    "method,k,params",
    [
        ("none", 0, {}),
        ("ngram", 6, {}),
        ("ngram", 6, {"logprobs": 3, "presence_penalty": 0.5, "logit_bias": {5: 1.0}}),
        ("draft_model", 3, {"temperature": 0.7, "top_p": 0.9}),
        ("eagle", 3, {"temperature": 0.7, "top_p": 0.9, "presence_penalty": 0.5}),
    ],
    ids=["plain", "ngram-verify", "verify-logprobs-penalties", "draft-model-sampled", "eagle-sampled"],
)
def test_a_step_uploads_once_and_downloads_once(
    tiny_llama_dir, tiny_draft_dir, tiny_llama_head_dir, monkeypatch, method, k, params
):
    """Every host->device and device->host crossing of a step goes through
    `models.transfer`, once each way, whatever the step does."""
    draft = {"draft_model": tiny_draft_dir, "eagle": tiny_llama_head_dir}.get(method)
    runner = make_runner(tiny_llama_dir, method, draft)
    tok = runner.target.tokenizer
    reqs = [
        running(f"t{i}", tok(p * 3).input_ids, i, seed=i, **({"temperature": 0} | params))
        for i, p in enumerate(PROMPTS)
    ]
    reqs[1].params.temperature = 0  # a greedy row among sampled ones
    step(runner, reqs, [0] * 4)
    if method == "ngram":  # host drafts for sure: two rows follow a prediction, two look up n-grams
        for r in reqs[:2]:
            r.prediction_ids = r.output_ids + [5, 6, 7, 8, 9, 10, 11]
    # Host data may reach the device only through the step's one upload: any other
    # tensor built from Python data, or read back, during the step is a defect.
    stray = []

    for name in ("tensor", "as_tensor"):
        real = getattr(torch, name)

        def spy(*args, _real=real, **kwargs):
            stray.extend(f for f in _callers() if not f.startswith("models/transfer.py"))
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch, name, spy)
    for name in ("tolist", "item", "cpu"):
        real = getattr(torch.Tensor, name)

        def spy_method(self, *args, _real=real, **kwargs):
            stray.extend(f for f in _callers() if not f.startswith("models/transfer.py"))
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, spy_method)
    with TransferCounter() as counter:
        rows = step(runner, reqs, [k] * 4)
    monkeypatch.undo()
    assert (counter.uploads, counter.downloads) == (1, 1)
    assert not stray, stray
    if k:
        assert any(r.num_draft_tokens for r in rows)


def _callers() -> list[str]:
    """The project's frames (models/, scheduler/, speculation/) on the current stack, as 'path:line'."""
    import traceback

    root = Path(__file__).resolve().parents[2]
    frames = []
    for frame in traceback.extract_stack()[:-2]:
        path = Path(frame.filename).resolve()
        if root in path.parents and path.parts[len(root.parts)] in ("models", "scheduler", "speculation"):
            frames.append(f"{path.relative_to(root)}:{frame.lineno}")
    return frames[-1:]


def test_the_kv_pool_is_sized_by_blocks_memory_or_sequences(tiny_llama_dir):
    from worker.builder import free_memory, num_kv_blocks

    target = load_model(ModelConfig(str(tiny_llama_dir), dtype="float32", device="cpu"))
    per_block = KVCache.bytes_per_block(target.model.config, BLOCK, torch.float32)
    assert num_kv_blocks(RunnerConfig(num_kv_blocks=7), target) == 7
    assert num_kv_blocks(RunnerConfig(kv_cache_memory=10 * per_block + 1, block_size=BLOCK), target) == 10
    assert num_kv_blocks(RunnerConfig(max_num_seqs=2, max_model_len=64, block_size=BLOCK), target) == 8
    fraction = num_kv_blocks(RunnerConfig(kv_cache_memory=0.001, block_size=BLOCK), target)
    assert fraction == pytest.approx(0.001 * free_memory(target.device) / per_block, rel=0.2)
    with pytest.raises(ValueError, match="holds no KV block"):
        num_kv_blocks(RunnerConfig(kv_cache_memory=per_block - 1, block_size=BLOCK), target)


def test_the_policy_is_told_each_rows_host_draft_before_the_step(tiny_llama_dir):
    """`host_draft_lengths` says how many tokens each row's n-gram or Predicted Outputs draft
    will carry, and the step that follows drafts exactly those; a row whose n-gram index
    matches nothing has none."""
    runner = make_runner(tiny_llama_dir)
    copying = running("copy", [7, 8, 9, 10, 11, 12, 13, 7, 8], 0)
    fresh = running("fresh", [20, 21, 22, 23], 1)  # no token repeats: nothing to look up
    predicted = running("pred", [30, 31, 32], 2)
    step(runner, [copying, fresh, predicted], [0, 0, 0])
    copying.output_ids[-1] = 9  # "... 7 8 9": the n-gram continues with 10 11 12 13 7 8 9
    fresh.output_ids[-1] = 24
    predicted.prediction_ids = predicted.output_ids + [40, 41]
    # Tokens never change once made; this test rewrites them, so drop what was drafted from the old ones.
    runner.free(["copy", "fresh", "pred"])
    for request in (copying, fresh, predicted):
        request.draft = None
    requests = [copying, fresh, predicted]
    assert runner.drafting.available(requests, [4, 4, 4]) == [4, 0, 2]
    assert runner.drafting.available(requests, [2, 4, 1]) == [2, 0, 1]
    rows = step(runner, requests, [4, 4, 4])
    assert [r.num_draft_tokens for r in rows] == [4, 0, 2]


def test_the_step_makes_the_next_host_draft_and_the_policy_only_reads_it(tiny_llama_dir, monkeypatch):
    """Host drafts are made once a step, at the end of the step before (the step thread), and
    carried on the request: the policy's lengths and the next step's drafts propose nothing."""
    from speculation.ngram import NgramProposer

    runner = make_runner(tiny_llama_dir)
    copying = running("copy", [7, 8, 9, 10, 11, 12, 13, 7, 8, 9, 10, 11, 12, 13, 7, 8], 0)
    (out,) = step(runner, [copying], [0])
    assert out.next_draft is not None
    assert out.next_draft.num_tokens == len(copying.prompt_ids) + len(copying.output_ids)
    calls = []
    real = NgramProposer.propose
    monkeypatch.setattr(
        NgramProposer, "propose", lambda self, r, k, pending=None: calls.append(len(r)) or real(self, r, k, pending)
    )
    (length,) = runner.drafting.available([copying], [4])
    assert length == len(out.next_draft.token_ids[:4])
    (verified,) = step(runner, [copying], [4])
    assert verified.num_draft_tokens == length
    assert calls == [1]  # once: the draft for the step after this one, made at its end


def test_rows_only_a_forward_can_draft_for_keep_what_they_asked(tiny_llama_dir, tiny_draft_dir):
    runner = make_runner(tiny_llama_dir, "draft_model", tiny_draft_dir)
    request = running("r", [20, 21, 22, 23], 0)
    step(runner, [request], [0])
    assert runner.drafting.available([request], [3]) == [3]


def test_a_draft_models_forwards_are_priced_by_its_weights_and_its_catch_up_reported(tiny_llama_dir, tiny_draft_dir):
    """The policy prices the draft model's forwards as the target's over as many rows, scaled by
    their weights, until steps measure them; a step reports the catch-up its first forward fed."""
    runner = make_runner(tiny_llama_dir, "draft_model", tiny_draft_dir)
    draft = runner.proposer.draft
    ratio = linear_params(draft.model) / linear_params(runner.target.model)
    assert runner.drafting.forward_cost_ratio == pytest.approx(ratio)
    request = running("c", runner.target.tokenizer(PROMPTS[0]).input_ids, 0)
    step(runner, [request], [0])  # the prompt: the draft model has seen none of it
    row = ScheduledRow(request, [request.output_ids[-1]], request.num_computed_tokens, True, 2)
    out = runner.execute(Batch(rows=[row]))
    assert out.num_draft_catch_up == request.num_computed_tokens  # the prompt; the last token is the row's own
    assert out.num_draft_rows == request.num_computed_tokens + 1 + 1  # that feed, then the second position


def test_a_row_is_finite_exactly_when_none_of_its_logits_is_nan_or_infinite():
    from worker.step_sampling import all_finite

    logits = torch.randn(5, 1000) * 50
    logits[1, 7] = float("nan")
    logits[2, 0] = float("inf")
    logits[3, 999] = float("-inf")
    assert all_finite(logits).tolist() == [True, False, False, False, True]


# -- drafts that end early (`DeviceProposer.stop_confidence`) --


def test_drafts_end_after_an_unsure_token_and_the_text_is_the_plain_one(tiny_llama_dir, tiny_draft_dir, monkeypatch):
    """At a stop confidence of 0.5 a row's draft ends after its first token the draft model
    gave less than even odds (the tiny draft is sure of none of its tokens): the verify holds
    only what was drafted, the forwards stop once every row has ended, and the draft model's
    KV holds exactly what the target kept. Beside rows that are sure, ended rows ride along
    in the forwards and verify only their own. Greedy rows and seeded sampled rows emit the
    plain text token for token."""
    runner = make_runner(tiny_llama_dir, "draft_model", tiny_draft_dir, stop_confidence=0.5)
    tok = runner.target.tokenizer

    sampled = [running(f"s{i}", tok(p).input_ids, i, temperature=0.8, seed=i) for i, p in enumerate(PROMPTS)]
    step(runner, sampled, [0] * 4)
    for _ in range(3):
        out = step_output(runner, sampled, [4] * 4)
        assert [row.num_draft_tokens for row in out.rows] == [1, 1, 1, 1]
        # Every row ended after the first forward (its catch-up): the other three never ran.
        assert out.num_draft_rows == out.num_draft_catch_up + len(sampled)
    for request in sampled:
        _draft_kv_matches_fresh_prefill(runner, request)
    runner.free([r.request_id for r in sampled])

    mixed = [
        running(f"m{i}", tok(p).input_ids, i, temperature=0.8 if i % 2 else 0, seed=i) for i, p in enumerate(PROMPTS)
    ]
    step(runner, mixed, [0] * 4)
    # Rows 0 and 2 sure of every token, 1 and 3 of none: one batch drafts both ways.
    monkeypatch.setattr(device_draft, "_confidence", lambda *_: torch.tensor([1.0, 0.0, 1.0, 0.0]))
    out = step_output(runner, mixed, [4] * 4)
    monkeypatch.undo()
    assert [row.num_draft_tokens for row in out.rows] == [4, 1, 4, 1]
    assert out.num_draft_rows == out.num_draft_catch_up + 4 * len(mixed)  # every row computed by all 4 forwards
    for request in mixed:
        _draft_kv_matches_fresh_prefill(runner, request)

    config = SchedulerConfig(max_num_seqs=4, max_model_len=256, spec=SpecConfig(num_speculative_tokens=4))

    def requests(tag: str, speculation) -> list[Request]:
        params = dict(max_tokens=20, ignore_eos=True, speculation=speculation)
        return [
            Request(f"{tag}{i}", tok(p).input_ids, SamplingParams(temperature=0.8 if i % 2 else 0, seed=i, **params))
            for i, p in enumerate(PROMPTS)
        ]

    spec, plain = run_offline(runner, config, requests("s", True)), run_offline(runner, config, requests("p", False))
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
