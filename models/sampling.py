"""Logits processing and sampling, vectorized over a ragged batch.

One step turns raw logits `[rows, n, vocab]` (n = 1 for plain rows, k + 1 for
verify rows) into probabilities, in this order: logit_bias -> repetition /
frequency / presence penalties -> greedy rows become a one-hot of the argmax
-> temperature -> top_k -> top_p -> min_p -> softmax. Draft and target
probabilities go through the same function, so the rejection sampler compares
like with like.

Randomness is counter-based: a uniform is a hash of (seed, output position,
stream), so a request's tokens never depend on its batch neighbours, on how
many steps it took, or on the device. A stream keeps the uses apart:
`STREAM_SAMPLE` for plain and recovered/bonus draws, `STREAM_ACCEPT` for the
accept test, `STREAM_DRAFT` for a draft model's own sampling. Each output
position consumes each stream at most once (only the first rejected position
of a verify step is emitted, and the next step starts after it), so the
uniforms that decide a token are always fresh.

A seeded request is *coupled* (`SamplingTensors.coupled`): its drafts are
verified against the plain path's own draw at each position
(`speculation.rejection.coupled_verify`), and a draft model drafts it with the
`STREAM_SAMPLE` uniform of the position it drafts, so its text is the plain
path's whatever speculated. Unseeded requests keep the rejection sampler,
which accepts the most a draft model's drafts (docs/determinism.md measures
the difference).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from models.transfer import DeviceArrays, HostBuffer
from scheduler.types import Request, SamplingParams

STREAM_SAMPLE = 0
STREAM_ACCEPT = 1
STREAM_DRAFT = 2
MIN_REPETITION_PENALTY = 1e-6


@dataclass
class SamplingTensors:
    """Per-row sampling parameters as tensors for one step. R = rows.

    The `has_*` / `*_greedy` flags are host booleans computed from the params,
    so a batch that uses no penalty, no filter or no bias skips that work
    entirely. The tensors come from the step's one upload (`plan` adds the
    host arrays to a `HostBuffer`, `resolve` reads them back on the device).
    """

    temperature: Tensor  # [R] float32, 0 for greedy rows
    top_p: Tensor  # [R] float32, 1 = off
    top_k: Tensor  # [R] int64, 0 = off
    min_p: Tensor  # [R] float32, 0 = off
    presence_penalty: Tensor  # [R] float32
    frequency_penalty: Tensor  # [R] float32
    repetition_penalty: Tensor  # [R] float32, 1 = off
    is_greedy: Tensor  # [R] bool
    seeds: Tensor  # [R] int64
    coupled: Tensor  # [R] bool: verified against the plain path's draw (seeded requests)
    coupled_index: Tensor | None  # the sampled coupled rows, where only some sampled rows are
    logit_bias: Tensor | None  # [R, V] float32, None when no row has a bias
    all_greedy: bool
    any_greedy: bool
    has_top_k: bool  # among sampled (non-greedy) rows
    has_top_p: bool
    has_min_p: bool
    has_penalties: bool
    any_coupled: bool  # among sampled rows
    all_coupled: bool

    @property
    def has_logit_bias(self) -> bool:
        return self.logit_bias is not None

    @staticmethod
    def plan(params: list[SamplingParams], vocab_size: int, buf: HostBuffer, prefix: str) -> None:
        """Add the rows' parameters to the step's upload. Bias entries for ids outside the vocabulary are dropped."""
        buf.floats(f"{prefix}.temperature", [p.temperature for p in params])
        buf.floats(f"{prefix}.top_p", [p.top_p for p in params])
        buf.ints(f"{prefix}.top_k", [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params])
        buf.floats(f"{prefix}.min_p", [p.min_p for p in params])
        buf.floats(f"{prefix}.presence", [p.presence_penalty for p in params])
        buf.floats(f"{prefix}.frequency", [p.frequency_penalty for p in params])
        # A penalty near 0 would divide logits into inf (NaN probabilities); 1e-6 acts the same.
        buf.floats(f"{prefix}.repetition", [max(p.repetition_penalty, MIN_REPETITION_PENALTY) for p in params])
        buf.bools(f"{prefix}.greedy", [p.is_greedy for p in params])
        buf.ints(f"{prefix}.seeds", [p.seed for p in params])
        buf.bools(f"{prefix}.coupled", [p.seeded for p in params])
        if _mixed_coupling(params):
            buf.ints(f"{prefix}.coupled_index", [r for r, p in enumerate(params) if p.seeded and not p.is_greedy])
        bias = _bias_entries(params, vocab_size)
        if bias:
            rows, ids, values = zip(*bias)
            buf.ints(f"{prefix}.bias_index", [r * vocab_size + i for r, i in zip(rows, ids)])
            buf.floats(f"{prefix}.bias_values", values)

    @classmethod
    def resolve(
        cls, params: list[SamplingParams], vocab_size: int, arrays: DeviceArrays, prefix: str
    ) -> SamplingTensors:
        greedy = [p.is_greedy for p in params]
        sampled = [p for p, g in zip(params, greedy) if not g]
        logit_bias = None
        if _bias_entries(params, vocab_size):
            values = arrays[f"{prefix}.bias_values"].to(torch.float32)
            logit_bias = torch.zeros(len(params) * vocab_size, dtype=torch.float32, device=values.device)
            logit_bias.index_add_(0, arrays[f"{prefix}.bias_index"], values)
            logit_bias = logit_bias.view(len(params), vocab_size)
        return cls(
            temperature=arrays[f"{prefix}.temperature"].to(torch.float32),
            top_p=arrays[f"{prefix}.top_p"].to(torch.float32),
            top_k=arrays[f"{prefix}.top_k"],
            min_p=arrays[f"{prefix}.min_p"].to(torch.float32),
            presence_penalty=arrays[f"{prefix}.presence"].to(torch.float32),
            frequency_penalty=arrays[f"{prefix}.frequency"].to(torch.float32),
            repetition_penalty=arrays[f"{prefix}.repetition"].to(torch.float32),
            is_greedy=arrays[f"{prefix}.greedy"],
            seeds=arrays[f"{prefix}.seeds"],
            coupled=arrays[f"{prefix}.coupled"],
            coupled_index=arrays[f"{prefix}.coupled_index"] if _mixed_coupling(params) else None,
            logit_bias=logit_bias,
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            has_top_k=any(0 < p.top_k < vocab_size for p in sampled),
            has_top_p=any(p.top_p < 1.0 for p in sampled),
            has_min_p=any(p.min_p > 0.0 for p in sampled),
            has_penalties=any(uses_penalties(p) for p in params),
            any_coupled=any(p.seeded for p in sampled),
            all_coupled=all(p.seeded for p in sampled),
        )

    def take(self, index: Tensor, params: list[SamplingParams]) -> SamplingTensors:
        """The rows at `index` (a device tensor; `params` are those rows' params)."""
        sampled = [p for p in params if not p.is_greedy]
        return SamplingTensors(
            temperature=self.temperature[index],
            top_p=self.top_p[index],
            top_k=self.top_k[index],
            min_p=self.min_p[index],
            presence_penalty=self.presence_penalty[index],
            frequency_penalty=self.frequency_penalty[index],
            repetition_penalty=self.repetition_penalty[index],
            is_greedy=self.is_greedy[index],
            seeds=self.seeds[index],
            coupled=self.coupled[index],
            coupled_index=None,  # only the step's verify reads it, never a subset's
            logit_bias=None
            if self.logit_bias is None or not _bias_entries(params, self.logit_bias.shape[1])
            else self.logit_bias[index],
            all_greedy=all(p.is_greedy for p in params),
            any_greedy=any(p.is_greedy for p in params),
            has_top_k=self.has_top_k and any(p.top_k > 0 for p in sampled),
            has_top_p=any(p.top_p < 1.0 for p in sampled),
            has_min_p=any(p.min_p > 0.0 for p in sampled),
            has_penalties=any(uses_penalties(p) for p in params),
            any_coupled=any(p.seeded for p in sampled),
            all_coupled=all(p.seeded for p in sampled),
        )


def _mixed_coupling(params: list[SamplingParams]) -> bool:
    """Some sampled rows coupled and some not: the verify then needs the coupled ones' index."""
    seeded = {p.seeded for p in params if not p.is_greedy}
    return len(seeded) == 2


def uses_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


def _bias_entries(params: list[SamplingParams], vocab_size: int) -> list[tuple[int, int, float]]:
    return [
        (row, token_id, value)
        for row, p in enumerate(params)
        for token_id, value in p.logit_bias.items()
        if 0 <= token_id < vocab_size
    ]


def plan_token_counts(histories: list[list[int]], buf: HostBuffer, prefix: str) -> None:
    """Add token histories to the step's upload, for `resolve_token_counts`."""
    flat = [t for history in histories for t in history]
    buf.ints(f"{prefix}.ids", flat)
    buf.ints(f"{prefix}.rows", [r for r, history in enumerate(histories) for _ in history])


def resolve_token_counts(num_rows: int, vocab_size: int, arrays: DeviceArrays, prefix: str) -> Tensor:
    """Per-row token counts `[R, V]` int32, in one scatter_add on the device."""
    ids, rows = arrays[f"{prefix}.ids"], arrays[f"{prefix}.rows"]
    counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=ids.device)
    in_vocab = (ids >= 0) & (ids < vocab_size)
    counts.view(-1).scatter_add_(0, rows * vocab_size + ids.clamp(0, vocab_size - 1), in_vocab.int())
    return counts


def plan_penalty_counts(requests: list[Request], buf: HostBuffer, prefix: str) -> bool:
    """When any row uses a penalty, add the rows' output and prompt tokens to the
    step's upload (for `resolve_penalty_counts`); returns whether it did."""
    if not any(uses_penalties(r.params) for r in requests):
        return False
    plan_token_counts([r.output_ids for r in requests], buf, f"{prefix}.out")
    plan_token_counts([r.prompt_ids for r in requests], buf, f"{prefix}.prompt")
    return True


def resolve_penalty_counts(num_rows: int, vocab_size: int, arrays: DeviceArrays, prefix: str) -> tuple[Tensor, Tensor]:
    """Output token counts `[R, V]` and the prompt-token mask `[R, V]` that `plan_penalty_counts` planned."""
    output_counts = resolve_token_counts(num_rows, vocab_size, arrays, f"{prefix}.out")
    prompt_mask = resolve_token_counts(num_rows, vocab_size, arrays, f"{prefix}.prompt") > 0
    return output_counts, prompt_mask


def process_logits(
    logits: Tensor,
    st: SamplingTensors,
    output_counts: Tensor | None,
    prompt_mask: Tensor | None,
    draft_ids: Tensor | None = None,
) -> Tensor:
    """Raw logits `[R, n, V]` -> probabilities `[R, n, V]` float32.

    `output_counts` `[R, V]` counts the tokens generated so far (presence and
    frequency penalties, OpenAI semantics); `prompt_mask` `[R, V]` marks prompt
    tokens (the repetition penalty sees prompt and output, as HF/vLLM). Both
    may be None when not `st.has_penalties`. Position j of a verify row has also
    seen `draft_ids[:, :j]` (`[R, n - 1]`; ids outside the vocabulary are
    padding and count for nothing), so every position is penalised exactly as
    plain decoding would penalise it. Greedy rows come back exactly one-hot.
    """
    logits = _biased_and_penalised(logits, st, output_counts, prompt_mask, draft_ids)
    if st.all_greedy:
        return _one_hot_argmax(logits)
    probs = _filtered_probs(logits, st)
    if st.any_greedy:
        probs = torch.where(st.is_greedy[:, None, None], _one_hot_argmax(logits), probs)
    return probs


def greedy_ids(
    logits: Tensor,
    st: SamplingTensors,
    output_counts: Tensor | None,
    prompt_mask: Tensor | None,
    draft_ids: Tensor | None = None,
) -> Tensor:
    """Argmax of the processed logits `[R, n, V]` -> `[R, n]`: the all-greedy fast
    path, equal to sampling from `process_logits` (exactly one-hot) with any u,
    without materialising probabilities."""
    if not (st.has_logit_bias or st.has_penalties):
        return argmax(logits)
    return argmax(_biased_and_penalised(logits, st, output_counts, prompt_mask, draft_ids))


ARGMAX_BLOCKS = 8


def argmax(x: Tensor) -> Tensor:
    """`x.argmax(-1)`, the first of equal maxima included, from the maxima of 8 column blocks:
    on CPU `argmax` scans a row serially, and over 49k columns at 32 rows this ran in 0.64 of
    its time (the blocks' `max` parallelises). Rows whose length 8 does not divide use argmax."""
    columns = x.shape[-1]
    if x.device.type != "cpu" or columns % ARGMAX_BLOCKS or x.numel() < (1 << 16):
        return x.argmax(dim=-1)
    blocks = x.reshape(*x.shape[:-1], ARGMAX_BLOCKS, columns // ARGMAX_BLOCKS)
    block_max, block_arg = blocks.max(dim=-1)  # [..., 8]: each block's first maximum
    best = block_max.argmax(dim=-1, keepdim=True)  # the first block holding the row's maximum
    return block_arg.gather(-1, best).squeeze(-1) + best.squeeze(-1) * (columns // ARGMAX_BLOCKS)


def _biased_and_penalised(logits, st, output_counts, prompt_mask, draft_ids) -> Tensor:
    logits = logits.to(torch.float32, copy=True)  # [R, n, V]
    if st.logit_bias is not None:
        logits += st.logit_bias[:, None, :]
    if st.has_penalties:
        _apply_penalties(logits, st, output_counts, prompt_mask, draft_ids)
    return logits


def _apply_penalties(
    logits: Tensor,
    st: SamplingTensors,
    output_counts: Tensor | None,
    prompt_mask: Tensor | None,
    draft_ids: Tensor | None,
) -> None:
    num_rows, n, vocab_size = logits.shape
    counts = torch.zeros(num_rows, n, vocab_size, dtype=logits.dtype, device=logits.device)
    if n > 1 and draft_ids is not None:
        # Position j has seen drafts 0..j-1: one-hot per draft, then a running sum.
        assert draft_ids.shape == (num_rows, n - 1), (draft_ids.shape, logits.shape)
        in_vocab = (draft_ids >= 0) & (draft_ids < vocab_size)  # [R, n - 1]
        counts[:, 1:].scatter_(-1, draft_ids.clamp(0, vocab_size - 1)[..., None], in_vocab[..., None].to(counts.dtype))
        counts = counts.cumsum(dim=1)
    if output_counts is not None:
        counts += output_counts[:, None, :].to(counts.dtype)  # [R, n, V]
    is_output = counts > 0
    is_seen = is_output if prompt_mask is None else is_output | prompt_mask[:, None, :]

    # Repetition penalty (CTRL, as HF/vLLM): a seen token's logit is divided by the
    # penalty when positive and multiplied by it when not, so > 1 always discourages.
    penalty = st.repetition_penalty[:, None, None]
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    logits.copy_(torch.where(is_seen, penalised, logits))
    # OpenAI: logit -= frequency * count + presence * (count > 0).
    logits -= st.frequency_penalty[:, None, None] * counts
    logits -= st.presence_penalty[:, None, None] * is_output.to(logits.dtype)


def _one_hot_argmax(logits: Tensor) -> Tensor:
    # Ties go to the lowest id (torch.argmax returns the first maximum).
    return torch.zeros_like(logits).scatter_(-1, argmax(logits)[..., None], 1.0)


def _filtered_probs(logits: Tensor, st: SamplingTensors) -> Tensor:
    # Greedy rows are replaced by the caller; divide them by 1, not 0.
    temperature = torch.where(st.is_greedy, torch.ones_like(st.temperature), st.temperature)
    logits = logits / temperature[:, None, None]  # [R, n, V]
    if st.has_top_k or st.has_top_p:
        logits = _top_k_top_p(logits, st.top_k, st.top_p, st.has_top_p)
    if st.has_min_p:
        # p_i >= min_p * p_max  <=>  logit_i >= max_logit + log(min_p); log(0) = -inf keeps all.
        threshold = logits.amax(dim=-1, keepdim=True) + torch.log(st.min_p)[:, None, None]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    # A row with nothing finite left (e.g. an all -inf padding row) becomes uniform, not NaN.
    logits = logits.masked_fill(torch.isneginf(logits.amax(dim=-1, keepdim=True)), 0.0)
    return logits.softmax(dim=-1)


def _top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor, has_top_p: bool) -> Tensor:
    """Both filters from one descending sort per row-position. top_k 0 / top_p 1 = off."""
    vocab_size = logits.shape[-1]
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True, stable=True)  # [R, n, V]
    ranks = torch.arange(vocab_size, device=logits.device)  # [V]
    k = torch.where(top_k > 0, top_k, vocab_size)  # [R]
    sorted_logits = sorted_logits.masked_fill(ranks >= k[:, None, None], float("-inf"))
    if has_top_p:
        # Keep the smallest prefix whose mass reaches top_p: a token stays while
        # the mass strictly before it is < top_p, so the top token always stays.
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = F.pad(sorted_probs.cumsum(dim=-1)[..., :-1], (1, 0))  # [R, n, V]
        p = top_p[:, None, None]
        # (rank > 0: a top_p that underflows to 0.0 in float32 must still keep the top token.)
        sorted_logits = sorted_logits.masked_fill((mass_before >= p) & (p < 1.0) & (ranks > 0), float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_ids, sorted_logits)


# splitmix64 (Steele, Lea, Flood 2014) constants, as signed int64.
def _as_int64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN_GAMMA = _as_int64(0x9E3779B97F4A7C15)
_MIX_MUL_1 = _as_int64(0xBF58476D1CE4E5B9)
_MIX_MUL_2 = _as_int64(0x94D049BB133111EB)


def _shift_right(x: Tensor, bits: int) -> Tensor:
    # torch's >> on int64 is arithmetic; masking off the copied sign bits makes it logical.
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(x: Tensor) -> Tensor:
    # int64 add and multiply wrap modulo 2**64, which is what splitmix64 wants.
    z = x + _GOLDEN_GAMMA
    z = (z ^ _shift_right(z, 30)) * _MIX_MUL_1
    z = (z ^ _shift_right(z, 27)) * _MIX_MUL_2
    return z ^ _shift_right(z, 31)


def uniform_noise(seeds: Tensor, positions: Tensor, stream: int) -> Tensor:
    """Counter-based uniforms: seeds `[R]` int64, positions `[R, n]` int64 -> `[R, n]` float64 in [0, 1).

    A splitmix64 hash of (seed, position, stream) in torch int64 ops, so it is
    stateless, the same on CPU and GPU, and independent of batch composition.
    """
    h = _mix64(seeds.to(torch.int64)[:, None])  # [R, 1]
    h = _mix64(h ^ positions.to(torch.int64))  # [R, n]
    h = _mix64(h ^ stream)
    return _shift_right(h, 11).to(torch.float64) * 2.0**-53  # top 53 bits


def draft_noise(st: SamplingTensors, positions: Tensor) -> Tensor:
    """The uniforms `[R, n]` a draft model draws output `positions` `[R, n]` with: a coupled
    row's are the plain path's own (`STREAM_SAMPLE`), so its draft lands on the plain token
    wherever q's interval overlaps p's; the others draw on `STREAM_DRAFT`, independent of
    the verify's uniforms as the rejection sampler needs."""
    if not st.any_coupled:
        return uniform_noise(st.seeds, positions, STREAM_DRAFT)
    if st.all_coupled:
        return uniform_noise(st.seeds, positions, STREAM_SAMPLE)
    return torch.where(
        st.coupled[:, None],
        uniform_noise(st.seeds, positions, STREAM_SAMPLE),
        uniform_noise(st.seeds, positions, STREAM_DRAFT),
    )


# Ids per block of the two-level inverse CDF (`sample_from_probs`).
SAMPLE_BLOCK = 256


def sample_from_probs(probs: Tensor, u: Tensor) -> Tensor:
    """Inverse-CDF draw: probs `[..., V]` (need not be normalised), u `[...]` float64 -> ids `[...]` int64.

    Picks the first id whose cumulative mass exceeds u * total, so an id with
    zero mass is never picked; rounding past the end falls back to the last id
    with mass. An all-zero row returns 0.

    In two levels: the running mass of 256-id blocks (each block's sum
    vectorized in float32, the running sum over blocks in float64), then a
    float64 running sum inside the one block the draw lands in. torch's running
    sum over a whole vocabulary is serial: at 16 rows x 5 verify positions x
    49k ids it took 39 ms on one core, and the float64 widening of every
    probability 20 ms more; this reads the probabilities once. A block's sum
    and its running sum round apart by ~1e-7 of its mass; a draw in between
    takes the block's last id with mass. A row's draw depends on its own values
    only, whatever else is in the call, so every path that draws a position
    (plain, verify, a draft model's coupled draft) draws it alike.
    """
    *lead, vocab = probs.shape
    pad = -vocab % SAMPLE_BLOCK
    blocks = (F.pad(probs, (0, pad)) if pad else probs).reshape(*lead, -1, SAMPLE_BLOCK)  # [..., nb, B]
    block_cdf = blocks.sum(dim=-1).to(torch.float64).cumsum(dim=-1)  # [..., nb]
    total = block_cdf[..., -1:].contiguous()  # [..., 1]
    target = u.to(torch.float64)[..., None] * total  # [..., 1]
    block = torch.searchsorted(block_cdf, target, right=True)  # the first block whose mass passes it
    block = torch.minimum(block, torch.searchsorted(block_cdf, total))  # rounding past the end: the last with mass
    block = block.clamp(max=block_cdf.shape[-1] - 1)  # NaN mass (a faulty row, discarded) must still index
    before = torch.where(block > 0, block_cdf.gather(-1, (block - 1).clamp(min=0)), 0.0)  # [..., 1]
    index = block[..., None].expand(*block.shape[:-1], 1, SAMPLE_BLOCK)
    inner = blocks.gather(-2, index).squeeze(-2).to(torch.float64).cumsum(dim=-1) + before  # [..., B]
    within = torch.searchsorted(inner, target, right=True)
    within = torch.minimum(within, torch.searchsorted(inner, inner[..., -1:].contiguous()))
    return (block * SAMPLE_BLOCK + within).clamp(max=vocab - 1).squeeze(-1)


def compute_logprobs(logits: Tensor, token_ids: Tensor, top_n: int) -> tuple[Tensor, Tensor, Tensor]:
    """Raw logits `[..., V]`, chosen ids `[...]` -> (chosen logprob `[...]`, top ids `[..., top_n]`,
    top logprobs `[..., top_n]`).

    Log-probabilities of the model's own distribution (log_softmax of the raw
    logits, before any penalty or filter), as OpenAI reports them. Negative
    ids (padding) read id 0's.
    """
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)  # [..., V]
    chosen = logprobs.gather(-1, token_ids.clamp(min=0)[..., None]).squeeze(-1)
    top_logprobs, top_ids = logprobs.topk(top_n, dim=-1)
    return chosen, top_ids, top_logprobs
