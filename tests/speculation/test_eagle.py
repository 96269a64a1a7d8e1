"""The EAGLE proposer: lossless (greedy exact, sampled in distribution), features and
drafts equal to an unpaged reference, acceptance with a head that knows the answer,
refusal of a head made for another model, and a failing head costing only drafts."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from models.eagle_head import HeadMismatch, held_out_rates, load_head
from models.linear_kernels import (
    PADDED,
    RUNGS,
    STANDARD_LAYOUT,
    TRANSPOSED,
    UNTUNED,
    KernelTable,
    ModelKernels,
    TunedLinear,
)
from models.loader import ModelConfig, load_model
from models.transfer import HostBuffer
from scheduler.engine import AsyncEngine
from scheduler.offline import run_offline
from scheduler.scheduler import SchedulerConfig
from scheduler.types import Batch, Request, RequestStatus, SamplingParams, ScheduledRow
from server.protocol import SpeculationInfo
from speculation.config import ProposerConfig, SpecConfig
from speculation.cost_model import step_shape
from speculation.eagle import EagleProposer
from tests.support.cycle import build_cycle_head, cycle_ids
from tests.support.stats import same_token_distribution_p_value
from tests.support.tensors import slot_table
from tests.support.tiny_models import build_head
from worker.builder import build_runner
from worker.runner import ModelRunner, RunnerConfig

PROMPTS = ["Hello world! How are you", "def add(a, b):\n    return", "A B C D E F G", "for i in range(10):\n"]
SLOTS, MAX_LEN, BLOCK = 4, 256, 16


def eagle_runner(
    model_dir: Path, head_dir: Path, max_num_seqs: int = SLOTS, stop_confidence: float = 0.0, **runner
) -> ModelRunner:
    """A runner whose head drafts every row's k (unless `stop_confidence` ends drafts early)."""
    target = load_model(ModelConfig(str(model_dir), dtype="float32", device="cpu"))
    return build_runner(
        target,
        RunnerConfig(max_num_seqs=max_num_seqs, max_model_len=MAX_LEN, block_size=BLOCK, **runner),
        ProposerConfig("eagle", draft_head=str(head_dir), stop_confidence=stop_confidence),
    )


def sched_config(runner: ModelRunner, max_num_seqs: int = SLOTS, **spec) -> SchedulerConfig:
    spec.setdefault("num_speculative_tokens", 4)
    return SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_queue=4000,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=256,
        eos_token_ids=runner.target.eos_token_ids,
        spec=SpecConfig(**spec),
        num_kv_blocks=runner.config.num_kv_blocks,
        block_size=runner.config.block_size,
    )


def greedy(tokenizer, tag: str, speculation, n: int = 32, predictions=None) -> list[Request]:
    out = []
    for i, prompt in enumerate(PROMPTS):
        mode = speculation[i] if isinstance(speculation, list) else speculation
        params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, speculation=mode)
        out.append(Request(f"{tag}{i}", tokenizer(prompt).input_ids, params))
        if predictions and predictions[i] is not None:
            out[-1].prediction_ids = predictions[i]
    return out


@pytest.fixture(scope="module", params=["llama", "qwen2", "llama-fused"])
def head_runner(request, tiny_llama_dir, tiny_qwen2_dir, tmp_path_factory) -> ModelRunner:
    """A perturbed untrained head whose draft vocabulary leaves out a quarter of the tokens,
    over the last hidden state or (-fused) the fused layers' states."""
    model_dir = tiny_qwen2_dir if request.param == "qwen2" else tiny_llama_dir
    vocab = AutoModelForCausalLM.from_pretrained(model_dir).get_output_embeddings().weight.shape[0]
    head_dir = build_head(model_dir, tmp_path_factory.mktemp("heads") / request.param, seed=3,
                          draft_vocab=[t for t in range(vocab) if t % 4 != 3],
                          fused=request.param.endswith("fused"))  # fmt: skip
    return eagle_runner(model_dir, head_dir)


def test_greedy_with_the_head_equals_plain_alone_and_in_mixed_batches(head_runner):
    runner = head_runner
    config, tok = sched_config(runner), runner.target.tokenizer
    plain = [c.token_ids for c in run_offline(runner, config, greedy(tok, "off", False))]
    spec = run_offline(runner, config, greedy(tok, "on", True))
    assert [c.token_ids for c in spec] == plain
    assert all(c.num_draft_tokens > 0 for c in spec)
    # Eagle rows, a plain row and a Predicted Outputs row (half right) in the same forwards.
    prediction = plain[3][:12] + [5] * 6 + plain[3][18:]
    mixed = run_offline(
        runner, config, greedy(tok, "mix", [True, False, True, True], predictions=[None] * 3 + [prediction])
    )
    assert [c.token_ids for c in mixed] == plain
    assert mixed[1].num_draft_tokens == 0 and mixed[0].num_draft_tokens > 0
    assert mixed[3].num_accepted_tokens >= 10  # the prediction row drafted from its prediction
    for i in range(len(PROMPTS)):
        (alone,) = run_offline(runner, config, greedy(tok, f"one{i}", True)[i : i + 1])
        assert alone.token_ids == plain[i]


def test_rows_draft_by_lookup_beside_the_head_and_output_stays_exact(tiny_llama_dir, tiny_llama_head_dir):
    """Auto rows beside a head draft by prompt lookup where their lookup drafts pay (the tiny
    model falls into loops that lookup copies), in the same forwards as head rows, a plain
    row and a prediction row; every row's output equals plain decoding."""
    runner = eagle_runner(tiny_llama_dir, tiny_llama_head_dir)
    assert runner.lookup is not None and runner.drafting.lookup is not None
    config, tok = sched_config(runner, num_speculative_tokens=5), runner.target.tokenizer
    plain = [c.token_ids for c in run_offline(runner, config, greedy(tok, "off", False, n=64))]
    methods: list[str] = []
    execute = runner.execute

    def recording(batch: Batch):
        output = execute(batch)
        methods.extend(row.method for row in output.rows if row.method)
        return output

    runner.execute = recording  # type: ignore[method-assign]
    prediction = plain[3][:12] + [5] * 6 + plain[3][18:]
    modes = ["auto", False, True, "auto"]
    mixed = run_offline(runner, config, greedy(tok, "mix", modes, n=64, predictions=[None] * 3 + [prediction]))
    assert [c.token_ids for c in mixed] == plain
    assert mixed[1].num_draft_tokens == 0
    assert {"ngram", "eagle", "prediction"} <= set(methods)
    auto = run_offline(runner, config, greedy(tok, "auto", "auto", n=64))
    assert [c.token_ids for c in auto] == plain
    assert sum(c.num_accepted_tokens for c in auto) > 0


def test_sampled_output_is_the_targets_distribution_with_tokens_outside_the_draft_vocabulary(head_runner, tmp_path):
    """Two-sample chi-square on the token at output position 1 (always from a verify step),
    with a head whose draft vocabulary leaves out the two tokens the target samples most
    there: its q is 0 on them, and the target must still emit them as often."""
    plain_runner = head_runner
    model_dir = Path(plain_runner.target.model_id)
    config = sched_config(plain_runner, max_num_seqs=16, spec_disable_batch_size=16)
    ids = plain_runner.target.tokenizer("Hello world").input_ids
    num = 1500

    def batch(tag, speculation):
        params = dict(max_tokens=3, temperature=1.5, ignore_eos=True, speculation=speculation)
        return [Request(f"{tag}{i}", ids, SamplingParams(seed=i, **params)) for i in range(num)]

    plain = run_offline(plain_runner, config, batch("off", False))
    counts: dict[int, int] = {}
    for c in plain:
        counts[c.token_ids[1]] = counts.get(c.token_ids[1], 0) + 1
    top = sorted(counts, key=counts.__getitem__)[-2:]
    vocab = plain_runner.target.vocab_size
    head_dir = build_head(model_dir, tmp_path / "head", seed=4, draft_vocab=[t for t in range(vocab) if t not in top])
    runner = eagle_runner(model_dir, head_dir, max_num_seqs=16)
    spec = run_offline(runner, config, batch("on", True))
    assert sum(c.num_draft_tokens for c in spec) >= num
    assert 0 < sum(c.num_accepted_tokens for c in spec) < sum(c.num_draft_tokens for c in spec)
    assert sum(c.token_ids[1] in top for c in spec) >= 0.5 * sum(counts[t] for t in top)
    # Fixed seeds: deterministic; a biased sampler gives p ~ 0.
    assert same_token_distribution_p_value(plain, spec) > 1e-3


# -- the proposer against an unpaged reference --


def running(rid: str, prompt: list[int], slot: int, **params) -> Request:
    params.setdefault("temperature", 0)
    request = Request(rid, prompt, SamplingParams(max_tokens=64, ignore_eos=True, **params))
    request.status, request.block_ids = RequestStatus.RUNNING, slot_table(slot, SLOTS, MAX_LEN // BLOCK)
    return request


def step(runner: ModelRunner, request: Request, k: int):
    """One step of `request` (its whole prompt first), applied as the scheduler would."""
    if request.num_computed_tokens < len(request.prompt_ids):
        row = ScheduledRow(request, request.prompt_ids, 0, sample=True)
    else:
        row = ScheduledRow(request, [request.output_ids[-1]], request.num_computed_tokens, True, k)
    output = runner.execute(Batch(rows=[row]))
    (out,) = output.rows
    assert out.error is None
    request.num_computed_tokens = row.start_pos + len(row.token_ids) + out.num_accepted_tokens
    request.output_ids += out.token_ids
    return output


@torch.inference_mode()
def reference_q(model_dir: Path, head_dir: Path, tokens: list[int], num_computed: int, drafts: list[int]):
    """Target features from HF's own forward, then the head over one causal sequence (no cache):
    position p reads f_p and x_{p+1}; each chained position appends (g, the draft made there).
    Returns the features and q (temperature 1) at each draft position."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    head = load_head(head_dir, model, attn_implementation="sdpa")
    out = model.model(torch.tensor([tokens[:num_computed]]), output_hidden_states=True)
    layers = head.config.feature_layers
    states = torch.cat([out.hidden_states[i][0] for i in layers], -1) if layers else out.last_hidden_state[0]
    hidden = head.target_features(states)
    features, ids = hidden, torch.tensor(tokens[1 : num_computed + 1])
    q = []
    for draft in drafts:
        g = head(features, ids, torch.arange(len(ids)))[-1:]
        q.append(head.full_logits(g)[0].softmax(-1))
        features, ids = torch.cat([features, g]), torch.cat([ids, torch.tensor([draft])])
    return hidden, torch.stack(q)


@pytest.mark.parametrize("features", ["last", "fused"])
def test_features_and_q_after_rejections_equal_an_unpaged_reference(
    features, tiny_llama_dir, tiny_llama_head_dir, tiny_llama_fused_head_dir
):
    """Verify steps reject drafts (their positions got features and head KV), plain steps
    run, then the head drafts again: the pool holds the target's features of every
    computed position (the last hidden state, or the fused layers' states fused), and q at
    every draft position is what the head gives over the true features and tokens, with
    the drafts chained."""
    head_dir = tiny_llama_fused_head_dir if features == "fused" else tiny_llama_head_dir
    runner = eagle_runner(tiny_llama_dir, head_dir)
    proposer = runner.proposer
    assert isinstance(proposer, EagleProposer) and proposer.features is not None
    request = running("r", runner.target.tokenizer(PROMPTS[0]).input_ids, slot=2, temperature=1.0, seed=5)
    step(runner, request, 0)
    accepted = [step(runner, request, 4).rows[0].num_accepted_tokens for _ in range(3)]
    assert min(accepted) < 4  # rejected drafts left stale features and head KV behind
    for _ in range(2):
        step(runner, request, 0)
    step(runner, request, 3)
    n = request.num_computed_tokens
    buf = HostBuffer()
    plan = proposer.plan([request], [4], buf)
    draft_ids, q = proposer.run(plan, buf.upload(torch.device("cpu")))
    assert proposer._computed["r"] == n and q is not None
    hidden, expected = reference_q(tiny_llama_dir, head_dir, request.all_token_ids, n, draft_ids[0].tolist())
    rows = [request.block_ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
    torch.testing.assert_close(proposer.features[rows], hidden, atol=1e-4, rtol=0)
    torch.testing.assert_close(q[0], expected, atol=1e-5, rtol=1e-4)


# -- acceptance: a head that knows the cycle model's answer --


@pytest.mark.parametrize("leave_out", [0, 1], ids=["every-token", "one-token-outside"])
def test_a_perfect_head_is_accepted_and_a_token_outside_its_vocabulary_is_not(
    cycle_model_dir, cycle_text, tmp_path, leave_out
):
    cycle = cycle_ids(cycle_text.tokenizer)
    head_dir = build_cycle_head(cycle_model_dir, tmp_path / "head", leave_out=tuple(cycle[2:3] * leave_out))
    runner = eagle_runner(cycle_model_dir, head_dir)
    config = sched_config(runner)
    prompt = cycle_text.tokenizer.encode("\n", add_special_tokens=False)
    params = dict(max_tokens=40, ignore_eos=True, speculation=True)
    requests = [
        Request("greedy", prompt, SamplingParams(temperature=0, **params)),
        Request("sampled", prompt, SamplingParams(temperature=1.0, seed=7, **params)),
    ]
    outputs = run_offline(runner, config, requests)
    expected = cycle_text.next_ids(prompt, 40)
    for out in outputs:
        assert out.token_ids == expected  # the cycle model's margin makes sampling exact too
        if leave_out:  # every draft that should be the left-out token is rejected; the target emits it
            assert 0 < out.num_accepted_tokens < out.num_draft_tokens
        else:
            assert out.num_accepted_tokens == out.num_draft_tokens >= 30
    # Acceptance by draft position comes out of the step for this proposer as for the others.
    request = Request("step", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    request.status, request.block_ids = RequestStatus.RUNNING, slot_table(0, SLOTS, MAX_LEN // BLOCK)
    step(runner, request, 0)
    output = step(runner, request, 4)
    (row,) = output.rows
    assert row.method == "eagle" and row.num_draft_tokens == 4
    per_position = [1] * row.num_accepted_tokens + [0] * (4 - row.num_accepted_tokens)
    assert output.accepted_per_position == per_position
    if not leave_out:
        assert per_position == [1, 1, 1, 1]


def test_a_probe_drafts_one_unverified_token_that_the_emitted_token_grades(cycle_model_dir, cycle_text, tmp_path):
    """A probe: the head drafts one token for a row that runs plain, in the same forwards
    as a row that verifies, or alone; the token comes back unverified (the row emits one
    token and verifies nothing), and the step is priced as one draft forward."""
    head_dir = build_cycle_head(cycle_model_dir, tmp_path / "head")
    runner = eagle_runner(cycle_model_dir, head_dir)
    prompt = cycle_text.tokenizer.encode("\n", add_special_tokens=False)
    probed, verifying = running("probe", prompt, 0), running("verify", prompt, 1, temperature=1.0, seed=3)
    step(runner, probed, 0)
    step(runner, verifying, 0)

    def run(rows: list[ScheduledRow]):
        batch = Batch(rows=rows)
        output = runner.execute(batch)
        for row, out in zip(rows, output.rows):
            assert out.error is None
            row.request.num_computed_tokens = row.start_pos + 1 + out.num_accepted_tokens
            row.request.output_ids += out.token_ids
        return output.rows, step_shape(batch, output)

    def decode(request: Request, k: int = 0, probe: bool = False) -> ScheduledRow:
        return ScheduledRow(request, [request.output_ids[-1]], request.num_computed_tokens, True, k, probe=probe)

    for _ in range(3):
        (p, v), shape = run([decode(probed, probe=True), decode(verifying, k=3)])
        assert p.num_draft_tokens == 0 and p.method is None and len(p.token_ids) == 1
        assert p.probe_id == p.token_ids[0]  # a perfect head's guess is the emitted token
        assert v.num_accepted_tokens == 3 and v.probe_id is None
        assert shape.num_draft_forwards == 3
    (p,), shape = run([decode(probed, probe=True)])  # alone: the head runs in a step that verifies nothing
    assert p.probe_id == p.token_ids[0]
    assert not shape.is_spec and shape.num_draft_forwards == 1
    (p,), shape = run([decode(probed)])
    assert p.probe_id is None and shape.num_draft_forwards == 0
    assert probed.output_ids == cycle_text.next_ids(prompt, len(probed.output_ids))
    assert verifying.output_ids == cycle_text.next_ids(prompt, len(verifying.output_ids))


def test_a_failing_head_costs_the_step_its_drafts_never_a_request(tiny_llama_dir, tiny_llama_head_dir, caplog):
    runner = eagle_runner(tiny_llama_dir, tiny_llama_head_dir)
    config, tok = sched_config(runner), runner.target.tokenizer
    plain = [c.token_ids for c in run_offline(runner, config, greedy(tok, "off", False, n=12))]
    proposer = runner.proposer
    assert isinstance(proposer, EagleProposer)

    def broken(*args, **kwargs):
        raise RuntimeError("head bug")

    proposer.head.forward = broken
    with caplog.at_level(logging.ERROR):
        spec = run_offline(runner, config, greedy(tok, "on", True, n=12))
    assert [c.token_ids for c in spec] == plain
    assert all(c.error is None and c.num_draft_tokens == 0 for c in spec)
    assert "eagle proposer failed" in caplog.text


# -- building and describing --


def test_the_head_computes_with_the_targets_gemm_layouts_and_the_same_drafts(tiny_llama_dir, tiny_llama_head_dir):
    runner = eagle_runner(tiny_llama_dir, tiny_llama_head_dir)
    head = runner.proposer.head
    assert head.kernels is runner.target.kernels  # what the target was tuned to
    assert all(isinstance(m, TunedLinear) for m in (head.fc, head.layer.self_attn.q_proj, head.layer.mlp.down_proj))

    # Force each layout: the head's g and draft logits stay those of the standard layout.
    head = load_head(tiny_llama_head_dir, runner.target.model, attn_implementation="sdpa")  # no cache needed
    hidden = head.config.hidden_size
    features, ids = torch.randn(3, hidden), torch.tensor([5, 9, 11])
    positions = torch.tensor([4, 5, 6])
    with torch.inference_mode():
        head.use_kernels(UNTUNED)
        expected_g = head(features, ids, positions)
        expected = head.draft_logits(expected_g)
        one = head.draft_logits(expected_g[:1])
        for layouts in ((TRANSPOSED,) * len(RUNGS), (PADDED,) + (STANDARD_LAYOUT,) * (len(RUNGS) - 1)):
            table = KernelTable(layouts, (1.0,) * len(RUNGS))
            head.use_kernels(ModelKernels(table, table))
            g = head(features, ids, positions)
            torch.testing.assert_close(g, expected_g, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(head.draft_logits(g), expected, rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(head.draft_logits(g[:1]), one, rtol=1e-4, atol=1e-5)


def test_a_head_for_another_model_is_refused_with_the_reason(tiny_qwen2_dir, tiny_llama_head_dir):
    target = load_model(ModelConfig(str(tiny_qwen2_dir), dtype="float32", device="cpu"))
    with pytest.raises(HeadMismatch, match="trained for another model: architecture is 'Qwen2ForCausalLM'"):
        build_runner(
            target,
            RunnerConfig(max_num_seqs=2, max_model_len=64),
            ProposerConfig("eagle", draft_head=str(tiny_llama_head_dir)),
        )
    with pytest.raises(ValueError, match="--draft-head"):
        ProposerConfig("eagle")
    assert ProposerConfig(draft_head="d").method == "eagle"


def test_speculation_info_names_the_head_and_its_training(tiny_llama_dir, tiny_llama_head_dir):
    runner = eagle_runner(tiny_llama_dir, tiny_llama_head_dir)
    proposer = runner.proposer
    assert isinstance(proposer, EagleProposer)
    proposer.head.config.training = {"minutes": 3, "acceptance_per_position": [0.6, 0.4]}
    info = SpeculationInfo(**AsyncEngine(runner, sched_config(runner), inline=True).speculation_info())
    assert info.proposer == "eagle"
    assert info.draft_head == {
        "name": tiny_llama_head_dir.name,  # not where it lies on disk
        "draft_vocab_size": runner.target.vocab_size,
        "feature_layers": None,
        "training": {"minutes": 3, "acceptance_per_position": [0.6, 0.4]},
    }


def test_the_pool_is_sized_with_the_heads_kv_and_features(tiny_llama_dir, tiny_llama_head_dir):
    from models.kv_cache import KVCache
    from worker.builder import num_kv_blocks

    runner = eagle_runner(tiny_llama_dir, tiny_llama_head_dir, kv_cache_memory=2e6)
    target = runner.target
    per_block = KVCache.bytes_per_block(target.model.config, BLOCK, torch.float32)
    proposer = runner.proposer
    assert isinstance(proposer, EagleProposer) and proposer.features is not None
    extra = proposer.bytes_per_block(BLOCK)
    # One layer of K and V (2 KV heads x 16 dims here) and one feature row of 64 per position.
    assert extra == BLOCK * 4 * (2 * 2 * 16 + 64)
    memory = 10 * (per_block + extra) + 1
    assert num_kv_blocks(RunnerConfig(kv_cache_memory=memory, block_size=BLOCK), target, extra) == 10
    blocks = runner.config.num_kv_blocks
    assert proposer.cache is not None and proposer.cache.num_blocks == blocks
    assert proposer.features.shape == (blocks * BLOCK, 64)


def test_held_out_rates_turn_the_cumulative_record_into_conditional_rates():
    record = {"held_out": {"per_position": [0.25, 0.05, 0.0, 0.0]}}
    assert held_out_rates(record) == pytest.approx((0.25, 0.2, 0.0))  # nothing after a position never reached
    assert held_out_rates({}) == () and held_out_rates(None) == ()
    assert held_out_rates({"held_out": {"per_position": []}}) == ()
