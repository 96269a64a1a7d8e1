"""ModelRunner: executes one scheduled `Batch` as one target forward.

    prepare (host drafts, one upload) -> draft (device) -> forward -> sample/verify -> one download

Model-free proposers (n-gram, Predicted Outputs) draft on the host while the
step is prepared; a draft model or an EAGLE head drafts on the device after
the upload, and its tokens go into the target's input there. Beside a device
proposer, rows the policy gives to prompt lookup draft on the host instead, and rows
it probes get one unverified draft token from the device proposer in the same
forwards (returned with the step's results, for the policy to grade). For an EAGLE
head the target forward also keeps every token's last hidden state (the
head's features) in the proposer's feature pool. Every row's new tokens (prefill
chunk, last token, or last token + drafts) go through the target in one
packed forward, and one rejection-sampling call turns the logits into
1..K+1 tokens per sampling row. Plain rows are the k = 0 case, and a step
with no drafts takes the plain sampling path with no speculative work at all.

Host transfers: everything the step needs from the host is packed into one
buffer and uploaded once; the results come back in one download
(`models.transfer`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from models.eagle_head import held_out_rates
from models.forward import forward_step, forward_with_hidden
from models.kv_cache import ATTN_IMPLEMENTATION, KVCache, LayoutPlan
from models.loader import LoadedModel
from models.sampling import (
    STREAM_ACCEPT,
    STREAM_SAMPLE,
    SamplingTensors,
    argmax,
    compute_logprobs,
    greedy_ids,
    plan_penalty_counts,
    process_logits,
    resolve_penalty_counts,
    sample_from_probs,
    uniform_noise,
)
from models.transfer import DeviceArrays, HostBuffer, download
from scheduler.types import Batch, Request, RowOutput, ScheduledRow, StepOutput
from speculation.device_draft import DeviceDraft, DeviceProposer, DraftPlan
from speculation.host_drafts import HostDrafts
from speculation.proposers import Draft, NgramProposer, Proposer
from speculation.rejection import greedy_verify, rejection_sample
from speculation.suffix import SuffixProposer

logger = logging.getLogger("specd.models")


class RowFault(RuntimeError):
    """A failure attributable to one request; the engine fails only that request."""

    def __init__(self, request_id: str, message: str):
        super().__init__(message)
        self.request_id = request_id


@dataclass
class RunnerConfig:
    max_num_seqs: int = 16
    max_model_len: int = 2048
    # The KV pool: `num_kv_blocks` blocks of `block_size` positions; else as many
    # as `kv_cache_memory` holds (bytes, or a fraction <= 1 of the device's free
    # memory); else room for `max_num_seqs` sequences of `max_model_len`.
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: float | None = None
    # Test-only: honour SamplingParams.fault ("raise" | "nan") to inject faults.
    enable_fault_injection: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")
        if self.block_size < 1 or (self.num_kv_blocks is not None and self.num_kv_blocks < 1):
            raise ValueError("the KV pool needs at least one block of at least one token")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be > 0")


@dataclass
class StepPlan:
    """Host side of one step: what each row feeds and drafts, and the upload."""

    rows: list[ScheduledRow]
    host_drafts: list[Draft | None]  # model-free drafts, per row
    num_draft: list[int]  # per row, host or device drafts
    methods: list[str | None]  # proposer that drafted for each row
    draft: DraftPlan | None  # the device proposer's forwards, for `draft_rows`
    draft_rows: list[int]
    layout: LayoutPlan
    sample_rows: list[int]
    shadows: dict[int, list[int]] = field(default_factory=dict)  # row -> unverified draft
    # Rows the device proposer drafts one unverified token for (`ScheduledRow.probe`): its
    # plan's rows after `draft_rows`; their tokens, on the device once it ran.
    probe_rows: list[int] = field(default_factory=list)
    probe_ids: torch.Tensor | None = None  # [P]
    probe_q: torch.Tensor | None = None  # [P, V] q, when a probed row samples
    # [P] min(1, p(x) / q(x)): the chance the rejection sampler would accept each probe's
    # token, computed where any row samples (greedy rows: 1 or 0, as equality says).
    probe_accept: torch.Tensor | None = None
    buf: HostBuffer = field(default_factory=HostBuffer)

    @property
    def n_max(self) -> int:
        return max((self.num_draft[i] for i in self.sample_rows), default=0) + 1

    @property
    def any_draft(self) -> bool:
        return any(self.num_draft)


class ModelRunner:
    def __init__(
        self,
        target: LoadedModel,
        config: RunnerConfig,
        proposer: Proposer | DeviceProposer | None = None,
        lookup: NgramProposer | None = None,
    ):
        """`lookup`: beside a device proposer, prompt lookup for the rows the policy gives it
        (`ScheduledRow.use_lookup`) and the shadow drafts that teach the policy when to."""
        self.target = target
        self.config = config
        self.lookup = lookup if isinstance(proposer, DeviceProposer) else None
        self.host = HostDrafts(proposer, self.lookup)
        self.device = target.device
        self.vocab_size = target.vocab_size
        target.model.set_attn_implementation(ATTN_IMPLEMENTATION)
        assert config.num_kv_blocks is not None, "build_runner sizes the KV pool"
        self.cache = KVCache.for_model(
            target.model.config, config.num_kv_blocks, config.block_size, target.dtype, target.device
        )
        logger.info(
            "KV cache: %d blocks x %d tokens (%d tokens), %.1f MiB",
            config.num_kv_blocks,
            config.block_size,
            config.num_kv_blocks * config.block_size,
            self.cache.num_bytes / 2**20,
        )

    @property
    def proposer(self) -> Proposer | DeviceProposer | None:
        return self.host.proposer

    @proposer.setter
    def proposer(self, proposer: Proposer | DeviceProposer | None) -> None:  # one proposer for both sides
        self.host.proposer = proposer

    @property
    def proposer_name(self) -> str:
        return self.proposer.method if self.proposer else "none"

    @property
    def draft_head(self) -> dict | None:
        """The EAGLE head being served (path, draft vocabulary, training record), else None."""
        info = getattr(self.proposer, "info", None)
        return info() if info is not None else None

    @property
    def acceptance_prior(self) -> tuple[float, ...]:
        """Per draft position, the acceptance the proposer measured for itself (an EAGLE
        head's held-out record), for the policy to start its rows from; empty: none."""
        head = self.draft_head
        return held_out_rates(head.get("training")) if head else ()

    @property
    def lookup_drafts(self) -> Callable[[list[Request], list[int]], list[int]] | None:
        """For the policy: the lengths of the prompt-lookup drafts rows have now; None without lookup."""
        return self.host.lookup_lengths if self.lookup is not None else None

    def host_draft_lengths(self, requests: list[Request], num_tokens: list[int]) -> list[int]:
        """For the policy: each row's host-draft length now (`HostDrafts.lengths`)."""
        return self.host.lengths(requests, num_tokens)

    def free(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.host.free(request_id)

    @torch.inference_mode()
    def execute(self, batch: Batch) -> StepOutput:
        self.free(batch.finished_ids)
        rows = batch.rows
        if not rows:
            return StepOutput(rows=[])
        for row in rows:
            self._maybe_inject_fault(row, "raise")
        clock = _PhaseClock()
        plan, arrays, device_draft = self._prepare_and_draft(rows)
        clock.lap("draft" if plan.any_draft or plan.probe_rows else None)
        logits = self._forward(plan, arrays, device_draft)
        outputs = self._sample(plan, arrays, logits, device_draft) if plan.sample_rows else {}
        clock.lap(_forward_phase(plan))
        self.host.make_next([(plan.rows[i].request, outputs.get(plan.rows[i].request_id)) for i in plan.sample_rows])
        output = self._step_output(plan, outputs, clock.phases)
        if isinstance(self.proposer, SuffixProposer):
            output.suffix_cache_nodes = self.proposer.num_cache_nodes
        return output

    def preview_drafts(self, requests: list[Request], num_tokens: list[int]) -> list[list[float]]:
        """Per-token probabilities of the drafts the proposer would make now, for the policy to
        price (proposers that give them); the proposer keeps each draft for the step that follows."""
        if not isinstance(self.proposer, SuffixProposer):
            return [[] for _ in requests]
        try:
            drafts = self.proposer.propose(requests, num_tokens)
        except Exception:  # noqa: BLE001 - a failed draft costs speed, never a request
            logger.exception("suffix proposer failed while the step was planned; these rows plan no draft")
            return [[] for _ in requests]
        return [draft.token_probs or [] for draft in drafts]

    def _prepare_and_draft(self, rows: list[ScheduledRow]) -> tuple[StepPlan, DeviceArrays, DeviceDraft | None]:
        """Host drafts and the one upload, then a device proposer's drafts (if any).
        A failing draft model or head costs this step its drafts, never a request."""
        plan = self._prepare(rows)
        arrays = plan.buf.upload(self.device)
        if plan.draft is None:
            return plan, arrays, None
        assert isinstance(self.proposer, DeviceProposer)
        try:
            drafted = self.proposer.run(plan.draft, arrays)
            num_verify = len(plan.draft_rows)
            if plan.probe_rows:
                plan.probe_ids = drafted.token_ids[num_verify:, 0]
                plan.probe_q = None if drafted.probs is None else drafted.probs[num_verify:, 0]
            return plan, arrays, drafted.first(num_verify) if num_verify else None
        except Exception:  # noqa: BLE001 - a failed draft costs speed, never a request
            logger.exception("%s proposer failed; these rows decode plainly this step", self.proposer.method)
            plan = self._prepare(rows, device_drafting=False)
            return plan, plan.buf.upload(self.device), None

    @staticmethod
    def _step_output(plan: StepPlan, outputs: dict[str, RowOutput], phases: dict[str, float]) -> StepOutput:
        accepted_per_position = [0] * max(plan.num_draft)
        for out in outputs.values():
            for j in range(out.num_accepted_tokens):
                accepted_per_position[j] += 1
        return StepOutput(
            rows=[outputs.get(row.request_id) or RowOutput(row.request_id) for row in plan.rows],
            phase_seconds=phases,
            accepted_per_position=accepted_per_position,
        )

    # -- prepare: host-side drafting and the step's one upload --
    def _prepare(self, rows: list[ScheduledRow], device_drafting: bool = True) -> StepPlan:
        host_drafts, draft_rows = self.host.for_step(rows, device_drafting)
        num_draft = [len(d.token_ids) if d else 0 for d in host_drafts]
        methods = [d.method if d else None for d in host_drafts]
        for i in draft_rows:
            assert isinstance(self.proposer, DeviceProposer)
            num_draft[i] = rows[i].num_spec_tokens
            methods[i] = self.proposer.method
        lens = [len(row.token_ids) + k for row, k in zip(rows, num_draft)]
        probe_rows = []
        if isinstance(self.proposer, DeviceProposer) and device_drafting:
            probe_rows = [i for i, row in enumerate(rows) if row.probe and row.sample and not num_draft[i]]
        plan = StepPlan(
            rows=rows,
            host_drafts=host_drafts,
            num_draft=num_draft,
            methods=methods,
            draft=None,
            draft_rows=draft_rows,
            layout=LayoutPlan.build(
                [r.block_ids for r in rows], [r.start_pos for r in rows], lens, self.config.block_size
            ),
            sample_rows=[i for i, row in enumerate(rows) if row.sample],
            shadows=self.host.shadows(rows),
            probe_rows=probe_rows,
        )
        buf = plan.buf
        if draft_rows or probe_rows:
            assert isinstance(self.proposer, DeviceProposer)
            try:  # probes ride in the same forwards, after the rows that verify
                plan.draft = self.proposer.plan(
                    [rows[i].request for i in draft_rows + probe_rows],
                    [num_draft[i] for i in draft_rows] + [1] * len(probe_rows),
                    buf,
                )
            except Exception:  # noqa: BLE001 - a failed draft costs speed, never a request
                logger.exception("%s proposer failed; these rows decode plainly this step", self.proposer.method)
                return self._prepare(rows, device_drafting=False)
        plan.layout.add_to(buf, "layout")

        input_ids: list[int] = []
        keep: list[int] = []
        fill_pos: list[int] = []
        fill_src: list[int] = []
        k_max = plan.draft.k_max if plan.draft else 0
        draft_index = {row: d for d, row in enumerate(draft_rows)}
        for i, row in enumerate(rows):
            first_draft = len(input_ids) + len(row.token_ids)
            input_ids += row.token_ids
            if i in draft_index:
                fill_pos += range(first_draft, first_draft + num_draft[i])
                fill_src += range(draft_index[i] * k_max, draft_index[i] * k_max + num_draft[i])
                input_ids += [0] * num_draft[i]  # placeholders: the drafts are on the device
            elif (draft := host_drafts[i]) is not None:
                input_ids += draft.token_ids
            if row.sample:
                keep += range(len(input_ids) - num_draft[i] - 1, len(input_ids))
        buf.ints("input_ids", input_ids)
        buf.ints("keep", keep)
        if fill_pos:
            buf.ints("fill_pos", fill_pos)
            buf.ints("fill_src", fill_src)
        if plan.sample_rows:
            self._plan_sampling(plan)
        return plan

    def _plan_sampling(self, plan: StepPlan) -> None:
        buf, rows, n_max = plan.buf, plan.rows, plan.n_max
        requests = [rows[i].request for i in plan.sample_rows]
        position = {row: r for r, row in enumerate(plan.sample_rows)}  # step row -> sampling row
        params = [r.params for r in requests]
        SamplingTensors.plan(params, self.vocab_size, buf, "s")
        buf.ints("num_draft", [plan.num_draft[i] for i in plan.sample_rows])
        buf.ints("out_len", [len(r.output_ids) for r in requests])
        if n_max > 1:
            # Where each kept logit goes in the [rows, n_max] grid, and the host drafts (0 = padding).
            cells = [(r, j) for r, i in enumerate(plan.sample_rows) for j in range(plan.num_draft[i] + 1)]
            buf.ints("grid_index", [r * n_max + j for r, j in cells])
            buf.ints("grid_row", [r for r, _ in cells])
            grid: list[int] = []
            for i in plan.sample_rows:
                draft = plan.host_drafts[i]
                ids = draft.token_ids if draft is not None else []
                grid += ids + [0] * (n_max - 1 - len(ids))
            buf.ints("draft_grid", grid)
            buf.ints("draft_sample_rows", [position[i] for i in plan.draft_rows])
        if plan.probe_rows:
            buf.ints("probe_sample_rows", [position[i] for i in plan.probe_rows])
        plan_penalty_counts(requests, buf, "counts")
        nan_rows = [r for r, i in enumerate(plan.sample_rows) if self._maybe_inject_fault(rows[i], "nan")]
        if nan_rows:
            buf.ints("nan_rows", nan_rows)

    # -- forward --
    def _forward(self, plan: StepPlan, arrays: DeviceArrays, device_draft: DeviceDraft | None) -> torch.Tensor:
        input_ids = arrays["input_ids"]
        if device_draft is not None:
            input_ids = input_ids.clone()
            input_ids[arrays["fill_pos"]] = device_draft.token_ids.reshape(-1)[arrays["fill_src"]]
        layout = plan.layout.resolve(arrays, "layout")
        proposer = self.proposer if isinstance(self.proposer, DeviceProposer) else None
        if proposer is None or proposer.features is None:
            # [len(keep), V] in the model's dtype: `_sample` converts where it samples.
            return forward_step(self.target.model, self.cache, layout, input_ids, arrays["keep"], float_logits=False)
        # Every token's features, at its KV row: positions < num_computed_tokens then always hold
        # accepted tokens' (drafts the verify rejects are overwritten later, like their KV).
        logits, hidden = forward_with_hidden(
            self.target.model, self.cache, layout, input_ids, arrays["keep"], proposer.feature_layers
        )
        proposer.store_features(layout.token_dest, hidden)
        return logits

    # -- sample / verify --
    def _sample(
        self, plan: StepPlan, arrays: DeviceArrays, logits: torch.Tensor, device_draft: DeviceDraft | None
    ) -> dict[str, RowOutput]:
        rows, n_max, vocab = plan.rows, plan.n_max, logits.shape[-1]
        requests = [rows[i].request for i in plan.sample_rows]
        num_rows, device = len(requests), logits.device
        st = SamplingTensors.resolve([r.params for r in requests], vocab, arrays, "s")
        want_logprobs = any(r.params.logprobs is not None for r in requests)
        argmax_only = st.all_greedy and not (st.has_penalties or st.has_logit_bias or want_logprobs)
        if n_max > 1 and argmax_only and "nan_rows" not in arrays:
            return self._verify_greedy_packed(plan, arrays, logits, device_draft)
        if not argmax_only:  # probabilities, penalties and logprobs are computed in float32
            logits = logits.float()
        if n_max == 1:
            grid = logits[:, None, :]  # [rows, 1, V]
        else:
            grid = logits.new_zeros(num_rows * n_max, vocab)
            grid[arrays["grid_index"]] = logits
            grid = grid.view(num_rows, n_max, vocab)
        if "nan_rows" in arrays:
            grid[arrays["nan_rows"]] = float("nan")
        output_counts = prompt_mask = None
        if st.has_penalties:
            output_counts, prompt_mask = resolve_penalty_counts(num_rows, vocab, arrays, "counts")
        num_draft = arrays["num_draft"]
        draft_ids = self._draft_ids(arrays, num_rows, n_max, device_draft) if n_max > 1 else None
        if st.all_greedy:  # p and q are one-hot: compare argmaxes, no probabilities
            target_ids = greedy_ids(grid, st, output_counts, prompt_mask, draft_ids)  # [rows, n_max]
            if n_max == 1:
                num_accepted, token_ids = torch.zeros(num_rows, dtype=torch.long, device=device), target_ids
            else:
                assert draft_ids is not None
                num_accepted, token_ids = greedy_verify(draft_ids, num_draft, target_ids)
        else:
            probs = process_logits(grid, st, output_counts, prompt_mask, draft_ids)  # [rows, n_max, vocab]
            if plan.probe_ids is not None:
                plan.probe_accept = _probe_accept(plan, probs, arrays["probe_sample_rows"])
            positions = arrays["out_len"][:, None] + torch.arange(n_max, device=device)  # [rows, n_max]
            u_sample = uniform_noise(st.seeds, positions, STREAM_SAMPLE)
            if n_max == 1:
                num_accepted = torch.zeros(num_rows, dtype=torch.long, device=device)
                token_ids = sample_from_probs(probs, u_sample)  # [rows, 1]
            else:
                u_accept = uniform_noise(st.seeds, positions[:, :-1], STREAM_ACCEPT)
                assert draft_ids is not None
                q = self._draft_probs(arrays, draft_ids, num_draft, device_draft, vocab)
                num_accepted, token_ids = rejection_sample(draft_ids, num_draft, q, probs, u_accept, u_sample)
        finite = all_finite(grid.flatten(1))
        results = [torch.cat([finite[:, None].long(), num_accepted[:, None], token_ids], dim=1)]
        top_n = max((r.params.logprobs or 0 for r in requests), default=0)
        if want_logprobs:
            # Log-probabilities of the raw target distribution at every grid position; the host keeps the emitted ones.
            results += compute_logprobs(grid, token_ids, top_n)  # chosen, top ids, top logprobs
        host = download(*results, *_probe_results(plan))
        return self._outputs(plan, host, want_logprobs)

    def _verify_greedy_packed(
        self, plan: StepPlan, arrays: DeviceArrays, logits: torch.Tensor, device_draft: DeviceDraft | None
    ) -> dict[str, RowOutput]:
        """Greedy verify straight from the packed logits `[kept, V]`: no `[rows, n_max, V]`
        grid, so one long draft does not make every row's sampling n_max times larger."""
        num_rows, n_max, device = len(plan.sample_rows), plan.n_max, logits.device
        target_ids = torch.zeros(num_rows * n_max, dtype=torch.long, device=device)
        target_ids.index_copy_(0, arrays["grid_index"], argmax(logits))
        draft_ids = self._draft_ids(arrays, num_rows, n_max, device_draft)
        num_accepted, token_ids = greedy_verify(draft_ids, arrays["num_draft"], target_ids.view(num_rows, n_max))
        finite = torch.ones(num_rows, dtype=torch.long, device=device)
        finite.scatter_reduce_(0, arrays["grid_row"], all_finite(logits).long(), reduce="amin")
        host = download(torch.cat([finite[:, None], num_accepted[:, None], token_ids], dim=1), *_probe_results(plan))
        return self._outputs(plan, host, want_logprobs=False)

    @staticmethod
    def _draft_ids(arrays: DeviceArrays, num_rows: int, n_max: int, device_draft: DeviceDraft | None) -> torch.Tensor:
        """[rows, n_max - 1] drafts: the host ones as uploaded, a device proposer's from the device."""
        draft_ids = arrays["draft_grid"].view(num_rows, n_max - 1)
        if device_draft is not None:
            draft_ids = draft_ids.clone()
            k = device_draft.token_ids.shape[1]
            draft_ids[arrays["draft_sample_rows"], :k] = device_draft.token_ids
        return draft_ids

    def _draft_probs(
        self, arrays, draft_ids, num_draft, device_draft: DeviceDraft | None, vocab: int
    ) -> torch.Tensor | None:
        """q for the rejection sampler: None when every draft is one-hot (model-free or greedy)."""
        if device_draft is None or device_draft.probs is None:
            return None
        k_all = draft_ids.shape[1]
        valid = torch.arange(k_all, device=draft_ids.device) < num_draft[:, None]  # [rows, k]
        q = torch.nn.functional.one_hot(draft_ids, vocab).to(device_draft.probs.dtype) * valid[..., None]
        q[arrays["draft_sample_rows"], : device_draft.probs.shape[1]] = device_draft.probs
        return q

    def _outputs(self, plan: StepPlan, host: list[list], want_logprobs: bool) -> dict[str, RowOutput]:
        outputs: dict[str, RowOutput] = {}
        main = host[0]
        if want_logprobs:
            chosen, top_ids, top_lp = host[1:4]
        probes: dict[int, int] = {}
        accepts: dict[int, float] = {}
        if plan.probe_ids is not None:
            if plan.probe_accept is not None:
                accepts = dict(zip(plan.probe_rows, host[-1]))
            probes = dict(zip(plan.probe_rows, host[-1 - (plan.probe_accept is not None)]))
        for r, i in enumerate(plan.sample_rows):
            row = plan.rows[i]
            is_finite, n_acc, *ids = main[r]
            out = outputs[row.request_id] = RowOutput(row.request_id)
            if not is_finite:
                out.error = "the model produced non-finite logits for this request"
                continue
            out.token_ids = ids[: n_acc + 1]
            out.shadow_ids = plan.shadows.get(i)
            out.probe_id = probes.get(i)
            out.probe_accept = accepts.get(i)
            if plan.num_draft[i]:
                out.method = plan.methods[i]
                out.num_draft_tokens = plan.num_draft[i]
                out.num_accepted_tokens = n_acc
                if isinstance(self.proposer, DeviceProposer) and out.method == self.proposer.method:
                    self.proposer.verified(row.request_id, row.start_pos + len(row.token_ids) + n_acc)
            want = row.request.params.logprobs
            if want is not None:
                n = n_acc + 1
                out.logprobs = chosen[r][:n]
                out.top_logprobs = [list(zip(top_ids[r][j][:want], top_lp[r][j][:want])) for j in range(n)]
        return outputs

    def _maybe_inject_fault(self, row: ScheduledRow, kind: str) -> bool:
        if not self.config.enable_fault_injection or row.request.params.fault != kind:
            return False
        if kind == "raise":
            raise RowFault(row.request_id, "injected fault")
        return True


class _PhaseClock:
    """Seconds per step phase, for `specd_step_seconds{phase}`: each lap closes one."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str | None) -> None:
        now = time.perf_counter()
        if phase is not None:
            self.phases[phase] = now - self._last
        self._last = now


def _probe_results(plan: StepPlan) -> list[torch.Tensor]:
    """The probes' draft tokens (and their acceptance chances, if computed), to ride in the
    step's one download; none without probes."""
    if plan.probe_ids is None:
        return []
    return [plan.probe_ids] if plan.probe_accept is None else [plan.probe_ids, plan.probe_accept]


def _probe_accept(plan: StepPlan, probs: torch.Tensor, sample_rows: torch.Tensor) -> torch.Tensor:
    """min(1, p(x) / q(x)) per probe: x its token, p the target's processed distribution at the
    row's next position, q the proposer's (one-hot for a greedy row, so equality)."""
    assert plan.probe_ids is not None
    x = plan.probe_ids[:, None]
    p = probs[sample_rows, 0].gather(1, x)[:, 0]
    if plan.probe_q is None:
        return p.clamp(max=1.0)
    q = plan.probe_q.gather(1, x)[:, 0]
    return (p / q.clamp(min=1e-30)).clamp(max=1.0)


def all_finite(logits: torch.Tensor) -> torch.Tensor:
    """[R, V] -> [R] bool: no NaN or infinity in the row. A row's sum is finite exactly when its
    values are (a NaN or an infinity carries through; logits are nowhere near overflowing a
    float32 sum), and one reduction is ~15x cheaper than `isfinite(x).all()` on 49k columns."""
    return torch.isfinite(logits.sum(dim=-1))


def _forward_phase(plan: StepPlan) -> str:
    if any(row.request.is_prefilling for row in plan.rows):
        return "prefill"
    return "verify" if plan.any_draft else "decode"
