"""Speculation through the whole engine: lossless (greedy exact, sampled in
distribution), every proposer, mixed batches, and the plain path when off."""

from __future__ import annotations

import asyncio
import math

import pytest

from benchmarks.common import chat_ids
from models.linear_kernels import DENSE, QUANTIZED, ROWWISE, quantized_format
from models.loader import ModelConfig, load_model
from scheduler.engine import AsyncEngine
from scheduler.offline import collect, run_offline
from scheduler.scheduler import SchedulerConfig
from scheduler.types import Request, SamplingParams
from speculation.config import ProposerConfig, SpecConfig
from tests.support.stats import same_token_distribution_p_value
from worker.builder import build_runner
from worker.runner import RunnerConfig

PROMPTS = ["Hello world! How are you", "def add(a, b):\n    return", "A B C D E F G", "for i in range(10):\n"]
SAMPLING_EXTRAS = dict(
    presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={52: 3.0, 153: -5.0}
)


def runner_for(model_dir, method, draft=None, max_num_seqs=4, draft_head=None, lookup=True):
    target = load_model(ModelConfig(str(model_dir), dtype="float32", device="cpu"))
    # The target as its own draft keeps the target's weights (a draft is int4 by default).
    draft_weights = "bf16" if draft == model_dir else "auto"
    runner = build_runner(
        target,
        RunnerConfig(max_num_seqs=max_num_seqs, max_model_len=256),
        ProposerConfig(method, draft, draft_weights=draft_weights, draft_head=draft_head, lookup=lookup),
    )
    return target, runner


def config_for(target, max_num_seqs=4, max_queue=256, **spec):
    spec.setdefault("num_speculative_tokens", 4)
    return SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_queue=max_queue,
        max_model_len=256,
        max_num_batched_tokens=256,
        eos_token_ids=target.eos_token_ids,
        spec=SpecConfig(**spec),
    )


def requests(tokenizer, tag, speculation, n=32, predictions=None, **params):
    out = []
    for i, prompt in enumerate(PROMPTS):
        spec = speculation[i] if isinstance(speculation, list) else speculation
        r = Request(
            f"{tag}{i}",
            tokenizer(prompt).input_ids,
            SamplingParams(max_tokens=n, ignore_eos=True, speculation=spec, **{"temperature": 0, **params}),
        )
        if predictions:
            r.prediction_ids = predictions[i]
        out.append(r)
    return out


@pytest.fixture(params=["ngram", "suffix", "draft_weak", "draft_self", "eagle"])
def proposer(request, tiny_llama_dir, tiny_draft_dir, tiny_llama_head_dir):
    """ngram; suffix decoding; a 1-layer draft (mostly rejected); the target as its own draft (always
    accepted); an untrained EAGLE head (tests/models/test_eagle.py has more)."""
    if request.param in ("ngram", "suffix"):
        return runner_for(tiny_llama_dir, request.param)
    if request.param == "eagle":
        return runner_for(tiny_llama_dir, "eagle", draft_head=str(tiny_llama_head_dir))
    return runner_for(
        tiny_llama_dir, "draft_model", tiny_draft_dir if request.param == "draft_weak" else tiny_llama_dir
    )


@pytest.mark.parametrize("extras", [{}, SAMPLING_EXTRAS], ids=["plain", "penalties+bias"])
def test_greedy_speculation_equals_plain_output(proposer, extras):
    target, runner = proposer
    config = config_for(target)
    tok = target.tokenizer
    plain = [c.token_ids for c in run_offline(runner, config, requests(tok, "off", False, **extras))]
    spec = run_offline(runner, config, requests(tok, "on", True, **extras))
    assert [c.token_ids for c in spec] == plain
    assert sum(c.num_draft_tokens for c in spec) > 0
    # Mixed batch: rows 0 and 2 speculate, 1 and 3 never do, all in the same forwards.
    mixed = run_offline(runner, config, requests(tok, "mix", [True, False, True, False], **extras))
    assert [c.token_ids for c in mixed] == plain
    assert mixed[1].num_draft_tokens == 0 and mixed[3].num_draft_tokens == 0
    assert mixed[0].num_draft_tokens > 0
    for i in range(len(PROMPTS)):
        (alone,) = run_offline(runner, config, requests(tok, f"one{i}", True, **extras)[i : i + 1])
        assert alone.token_ids == plain[i]


def test_greedy_speculation_equals_plain_output_with_verify_rows_read_in_place(tiny_llama_dir):
    """Verify rows and the draft's catch-up through the paged kernel (`LoadedModel.paged_limits`),
    beside decode rows that always are: the same tokens as plain decoding."""
    target, runner = runner_for(tiny_llama_dir, "draft_model", tiny_llama_dir)
    target.paged_limits = runner.proposer.paged_limits = (8, 8, 8)
    config = config_for(target)
    tok = target.tokenizer
    plain = [c.token_ids for c in run_offline(runner, config, requests(tok, "off", False))]
    spec = run_offline(runner, config, requests(tok, "on", True))
    assert [c.token_ids for c in spec] == plain
    assert sum(c.num_accepted_tokens for c in spec) > 0


SEEDED = dict(temperature=0.9, seed=1234)


def test_seeded_sampled_output_is_the_plain_path_whatever_speculated(proposer):
    """A seeded request is verified against the plain path's own draws, so its sampled text
    is the same with speculation off, on, `auto`, in a mixed batch and alone, after whatever
    traffic came before it (the suffix proposer learns from each run)."""
    target, runner = proposer
    config = config_for(target)
    tok = target.tokenizer
    plain = [c.token_ids for c in run_offline(runner, config, requests(tok, "off", False, **SEEDED))]
    assert len({tuple(t) for t in plain}) == len(PROMPTS)
    spec = run_offline(runner, config, requests(tok, "on", True, **SEEDED))
    assert [c.token_ids for c in spec] == plain
    assert sum(c.num_draft_tokens for c in spec) > 0
    for tag, mode in (("auto", "auto"), ("mix", [True, False, True, False])):
        assert [c.token_ids for c in run_offline(runner, config, requests(tok, tag, mode, **SEEDED))] == plain
    for i in range(len(PROMPTS)):
        (alone,) = run_offline(runner, config, requests(tok, f"one{i}", True, **SEEDED)[i : i + 1])
        assert alone.token_ids == plain[i]


def test_seeded_rows_stay_coupled_beside_unseeded_ones(tiny_llama_dir, tiny_draft_dir):
    """One verify, both verifiers: the seeded rows (0 and 2) keep their plain text while the
    unseeded rows beside them go through the rejection sampler."""
    target, runner = runner_for(tiny_llama_dir, "draft_model", tiny_draft_dir)
    config = config_for(target)
    tok = target.tokenizer
    plain = [c.token_ids for c in run_offline(runner, config, requests(tok, "off", False, **SEEDED))]
    mixed = requests(tok, "mixed", True, **SEEDED)
    for request in mixed[1::2]:
        unseeded(request.params)
    spec = run_offline(runner, config, mixed)
    assert [c.token_ids for c in spec[0::2]] == plain[0::2]
    assert all(c.num_draft_tokens > 0 for c in spec)


def test_a_seeded_request_accepts_a_prediction_of_its_own_sampled_text(tiny_llama_dir):
    """Coupled verification accepts a draft exactly when it is the plain path's token: a
    prediction equal to the seeded plain text is accepted whole, at temperature 0.9."""
    target, runner = runner_for(tiny_llama_dir, "none")
    config = config_for(target)
    tok = target.tokenizer
    plain = [c.token_ids for c in run_offline(runner, config, requests(tok, "off", False, **SEEDED))]
    spec = run_offline(runner, config, requests(tok, "p", "auto", predictions=plain, **SEEDED))
    assert [c.token_ids for c in spec] == plain
    assert all(c.num_accepted_tokens == c.num_draft_tokens >= 20 for c in spec)


def test_suffix_drafts_from_earlier_outputs_and_stays_exact(tiny_llama_dir):
    """A second pass drafts from the first pass's cached outputs: exact, in a batch mixing
    forced, plain, auto and prediction rows; a tenant that never ran gets no such drafts."""
    target, runner = runner_for(tiny_llama_dir, "suffix")
    config = config_for(target)
    tok = target.tokenizer
    plain = [c.token_ids for c in run_offline(runner, config, requests(tok, "off", False))]
    first = run_offline(runner, config, requests(tok, "first", True))
    assert [c.token_ids for c in first] == plain
    modes = [True, False, "auto", "auto"]
    mixed = requests(tok, "warm", modes, predictions=[None, None, None, plain[3][:8] + [5] * 8])
    warm = run_offline(runner, config, mixed)
    assert [c.token_ids for c in warm] == plain
    assert warm[1].num_draft_tokens == 0
    assert warm[0].num_accepted_tokens == warm[0].num_draft_tokens > first[0].num_accepted_tokens
    other = requests(tok, "other", True)
    for r in other:
        r.tenant = "someone-else"
    cold = run_offline(runner, config, other)
    assert [c.token_ids for c in cold] == plain
    assert [c.num_accepted_tokens for c in cold] == [c.num_accepted_tokens for c in first]


def test_self_draft_accepts_everything(tiny_llama_dir):
    target, runner = runner_for(tiny_llama_dir, "draft_model", tiny_llama_dir)
    spec = run_offline(runner, config_for(target), requests(target.tokenizer, "s", True, n=33))
    for c in spec:
        assert c.num_accepted_tokens == c.num_draft_tokens > 0
        assert c.num_chunks < len(c.token_ids)  # several tokens per step


def test_probes_ride_in_the_draft_forwards_and_verify_nothing(tiny_llama_dir):
    """Every plain decode row is probed: the draft model drafts one token for it in the
    forwards that draft for the verifying rows, and it comes back unverified. The target
    as its own draft guesses each emitted token, the rows that verify accept every draft
    (the probed rows' draft KV stays right), and every row's output is the plain one."""
    target, runner = runner_for(tiny_llama_dir, "draft_model", tiny_llama_dir)
    config, tok = config_for(target), target.tokenizer
    plain = [c.token_ids for c in run_offline(runner, config, requests(tok, "off", False))]
    execute, probes = runner.execute, []

    def probing(batch):
        for row in batch.rows:
            row.probe = row.sample and not row.num_spec_tokens and bool(row.request.output_ids)
        output = execute(batch)
        probes.extend((out.probe_id, out.token_ids[0]) for out in output.rows if out.probe_id is not None)
        assert all(out.num_draft_tokens == 0 for row, out in zip(batch.rows, output.rows) if row.probe)
        return output

    runner.execute = probing  # type: ignore[method-assign]
    mixed = run_offline(runner, config, requests(tok, "mix", [True, False, True, False]))
    assert [c.token_ids for c in mixed] == plain
    assert mixed[1].num_draft_tokens == 0 and mixed[0].num_accepted_tokens == mixed[0].num_draft_tokens > 0
    assert len(probes) >= 2 * 30 and all(draft == emitted for draft, emitted in probes)


def sampled_probes(tiny_llama_dir, seed: int | None) -> list[tuple[int, int, float | None]]:
    """(probe token, emitted token, accept chance) of every probe, with the target as its own draft."""
    target, runner = runner_for(tiny_llama_dir, "draft_model", tiny_llama_dir)
    execute, probes = runner.execute, []

    def probing(batch):
        for row in batch.rows:
            row.probe = row.sample and bool(row.request.output_ids)
        output = execute(batch)
        probes.extend((out.probe_id, out.token_ids[0], out.probe_accept) for out in output.rows if out.probe_id)
        return output

    runner.execute = probing  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True, speculation=False)
    run_offline(runner, config_for(target), [Request(f"s{i}", target.tokenizer(p).input_ids, params)
                                            for i, p in enumerate(PROMPTS)])  # fmt: skip
    assert len(probes) >= 4 * 20
    return probes


def test_a_sampled_probe_is_graded_by_the_chance_it_would_be_accepted(tiny_llama_dir):
    """An unseeded row's emitted token is one draw of p: with the target as its own draft
    (q = p) it matches the probe's token only now and then, yet the rejection sampler would
    accept every such draft. The probe comes back with that chance, min(1, p(x) / q(x))."""
    probes = sampled_probes(tiny_llama_dir, seed=None)
    assert all(accept is not None and accept > 0.999 for _, _, accept in probes)
    assert sum(draft == emitted for draft, emitted, _ in probes) < len(probes) / 2


def test_a_seeded_probe_draws_the_plain_token_and_is_graded_by_it(tiny_llama_dir):
    """A seeded row is coupled: its draft is drawn with the plain draw's own uniform, so a
    draft whose q equals p lands on the emitted token every time, and the probe is graded by
    that equality (NaN chance)."""
    probes = sampled_probes(tiny_llama_dir, seed=11)
    assert all(draft == emitted for draft, emitted, _ in probes)
    assert all(accept is not None and math.isnan(accept) for _, _, accept in probes)


def test_prediction_is_used_as_the_draft(tiny_llama_dir):
    target, runner = runner_for(tiny_llama_dir, "none")
    config = config_for(target)
    tok = target.tokenizer
    plain = [c.token_ids for c in run_offline(runner, config, requests(tok, "off", False))]
    # Exact predictions for rows 0-1, a wrong one for row 2, a half-right one for row 3.
    predictions = [plain[0], plain[1], [5] * 32, plain[3][:10] + [7] * 5 + plain[3][15:]]
    spec = run_offline(runner, config, requests(tok, "p", "auto", predictions=predictions))
    assert [c.token_ids for c in spec] == plain
    assert spec[0].num_accepted_tokens == spec[0].num_draft_tokens >= 20  # ~K per step
    assert spec[2].num_accepted_tokens == 0
    assert spec[3].num_accepted_tokens > 10  # re-synchronised after the edit


class CountingProposer:
    """A device proposer that counts the steps it plans drafts for."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def plan(self, *args):
        self.calls += 1
        return self.inner.plan(*args)


def test_threshold_runs_plain_steps_without_proposer_calls(tiny_llama_dir, tiny_draft_dir):
    # Without prompt lookup beside it, whose shadows run on the host every step even above the cap.
    target, runner = runner_for(tiny_llama_dir, "draft_model", tiny_draft_dir, lookup=False)
    runner.proposer = CountingProposer(runner.proposer)
    tok = target.tokenizer
    config = config_for(target, spec_disable_batch_size=3)  # 4 running > 3
    run_offline(runner, config, requests(tok, "auto", "auto", n=8))
    assert runner.proposer.calls == 0
    run_offline(runner, config, requests(tok, "off", False, n=8)[:1])
    assert runner.proposer.calls == 0
    run_offline(runner, config, requests(tok, "one", "auto", n=8)[:1])
    assert runner.proposer.calls > 0


def unseeded(params: SamplingParams) -> SamplingParams:
    """`params` as if the server had drawn its seed: verified by the rejection sampler,
    yet fixed, so a statistical test stays deterministic."""
    params.seeded = False
    return params


@pytest.mark.parametrize("seeded", [False, True], ids=["rejection", "coupled"])
def test_sampled_distribution_with_speculation_matches_without(tiny_llama_dir, tiny_draft_dir, seeded):
    """Two-sample chi-square on the token at output position 1 — the first token
    produced by a verify step — with a weak draft so rejections happen. Seeded requests
    are coupled: their tokens are the plain run's, one for one."""
    target, runner = runner_for(tiny_llama_dir, "draft_model", tiny_draft_dir, max_num_seqs=16)
    config = config_for(target, max_num_seqs=16, max_queue=2000, spec_disable_batch_size=16)
    ids = target.tokenizer("Hello world").input_ids
    num = 1500

    def batch(tag, speculation):
        params = [
            SamplingParams(max_tokens=3, temperature=1.5, seed=i, ignore_eos=True, speculation=speculation)
            for i in range(num)
        ]
        return [Request(f"{tag}{i}", ids, p if seeded else unseeded(p)) for i, p in enumerate(params)]

    plain = run_offline(runner, config, batch("off", False))
    spec = run_offline(runner, config, batch("on", True))
    assert sum(c.num_draft_tokens for c in spec) >= num  # position 1 always comes from a verify
    assert 0 < sum(c.num_accepted_tokens for c in spec) < sum(c.num_draft_tokens for c in spec)
    if seeded:
        assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    # Fixed seeds: deterministic; a biased sampler gives p ~ 0.
    assert same_token_distribution_p_value(plain, spec) > 1e-3


async def _one_after_another(runner, config, sent: list[Request]) -> list[list[int]]:
    """Each request through one engine after the last, so a later one finds its prompt cached."""
    engine = AsyncEngine(runner, config, inline=True)
    await engine.start()
    try:
        return [(await collect(engine, r)).token_ids for r in sent]
    finally:
        await engine.stop(timeout=0)


def _assert_one_text_per_prompt(texts: list[list[int]], num_prompts: int) -> None:
    """`texts`: every prompt's text once per mode, mode by mode; each prompt's must be one text."""
    for i in range(num_prompts):
        runs = {tuple(text) for text in texts[i::num_prompts]}
        assert len(runs) == 1, f"prompt {i}: {len(runs)} different texts"


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_seeded_text_with_quantized_layers_is_the_same_however_its_steps_ran(tiny_llama_dir, method):
    """float32 with quantized layers (the default model's case): a token's products do not depend
    on the step that computed it (a prefill chunk, a cached prefix's tail, a decode, a verify), so
    a seeded request's text is one text under `speculation` false, true and `auto`, fresh and over
    its cached prefix. Before, a verify row that attention summed in another order than a one-token
    step could round a value to another int8 code, and the texts parted (SmolLM2: 12 of 12)."""
    target = load_model(ModelConfig(str(tiny_llama_dir), dtype="float32", device="cpu", weights="int4"))
    layer = target.model.model.layers[0].mlp.down_proj
    assert all(target.kernels.table_for(layer).layout(n) == QUANTIZED for n in (1, 5, 17, 300))
    alone = ROWWISE if quantized_format(target.model.get_output_embeddings()) == DENSE else QUANTIZED
    assert all(target.kernels.output.layout(n) == alone for n in (1, 5, 17, 300))
    runner = build_runner(target, RunnerConfig(max_num_seqs=4, max_model_len=256), ProposerConfig(method))
    modes = (False, True, "auto", False, True)
    sent = [r for k, mode in enumerate(modes) for r in requests(target.tokenizer, f"{k}-", mode, n=48, **SEEDED)]
    _assert_one_text_per_prompt(asyncio.run(_one_after_another(runner, config_for(target), sent)), len(PROMPTS))


def test_the_default_models_seeded_text_is_one_text_under_every_mode(specd_cache_dir):
    """The bundled SmolLM2 as served by default (its GGUF's quantized layers), in float32: four
    chat prompts, seeded at temperature 0.9, under `speculation` false, true and `auto`, fresh and
    over their cached prefixes, each give one text. Before weight-only kernels and paged attention
    served every step size, the first of these runs already parted within 20 tokens."""
    target = load_model(ModelConfig(cache_dir=specd_cache_dir, dtype="float32", device="cpu", tune_kernels=False))
    runner = build_runner(target, RunnerConfig(max_num_seqs=4, max_model_len=512), ProposerConfig("ngram"))
    prompts = ["Why do we have seasons on Earth?", "How does a refrigerator keep food cold?",
               "Give me three practical tips for sleeping better.", "What is compound interest?"]  # fmt: skip
    ids = [chat_ids(target, p) for p in prompts]
    modes = (False, True, "auto", False)
    params = dict(max_tokens=40, ignore_eos=True, temperature=0.9)
    sent = [
        Request(f"{k}-{i}", ids[i], SamplingParams(speculation=mode, seed=i, **params))
        for k, mode in enumerate(modes)
        for i in range(len(prompts))
    ]
    _assert_one_text_per_prompt(asyncio.run(_one_after_another(runner, config_for(target), sent)), len(prompts))
