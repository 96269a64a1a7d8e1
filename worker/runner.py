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
(`models.transfer`). Where a device proposer may end drafts early (on the CPU,
where a host copy is free), the target's part is planned once the drafts are
made, and uploaded second.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch

from models.forward import forward_step, forward_with_hidden
from models.grammar import GrammarState, fill_masks
from models.kv_cache import ATTN_IMPLEMENTATION, KVCache, LayoutPlan
from models.loader import LoadedModel
from models.sampling import SamplingTensors, plan_penalty_counts
from models.transfer import DeviceArrays, HostBuffer
from scheduler.types import Batch, Request, RowOutput, ScheduledRow, StepOutput
from speculation.host_drafts import HostDrafts
from speculation.proposer import Drafting, Proposer
from worker.step_sampling import PreparedStep, sample_step

logger = logging.getLogger("specd.worker")


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


class ModelRunner:
    def __init__(
        self,
        target: LoadedModel,
        config: RunnerConfig,
        proposer: Proposer | None = None,
        lookup: Proposer | None = None,
    ):
        """`proposer` drafts for the rows that speculate (allocated for the KV pool: `build_runner`).
        `lookup`: beside a proposer that drafts on the device, prompt lookup for the rows the policy
        gives it (`ScheduledRow.use_lookup`) and the shadow drafts that teach the policy when to."""
        self.target = target
        self.config = config
        self.proposer = proposer
        self.on_device = proposer is not None and proposer.capabilities.on_device
        self.lookup = lookup if self.on_device else None
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
    def drafting(self) -> Drafting:
        """The proposer and what the policy may ask of it while it plans a step."""
        proposer = self.proposer
        if proposer is None:
            return Drafting()
        return Drafting(
            method=proposer.method,
            prior_rates=proposer.prior_rates,
            preview=self.preview_drafts if proposer.capabilities.priced else None,
            lookup=self.host.lookup_lengths if self.lookup is not None else None,
            available=self.host.lengths,
            catch_up=proposer.feed_lengths if proposer.capabilities.on_device else None,
            forward_cost_ratio=proposer.forward_cost_ratio,
            recurring_feed=proposer.recurring_feed,
            info=proposer.info(),
        )

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
        plan, arrays = self._prepare_and_draft(rows)
        clock.lap("draft" if plan.any_draft or plan.probe_rows else None)
        logits = self._forward(plan, arrays)
        outputs = sample_step(plan, arrays, logits) if plan.sample_rows else {}
        clock.lap(_forward_phase(plan))
        self._verified(plan, outputs)
        self.host.make_next([(plan.rows[i].request, outputs.get(plan.rows[i].request_id)) for i in plan.sample_rows])
        output = self._step_output(plan, outputs, clock.phases)
        output.proposer_cache_nodes = self.proposer.cache_nodes if self.proposer is not None else None
        return output

    def preview_drafts(self, requests: list[Request], num_tokens: list[int]) -> list[list[float]]:
        """Per-token probabilities of the drafts the proposer would make now, for the policy to
        price (priced proposers); the proposer keeps each draft for the step that follows."""
        assert self.proposer is not None
        try:
            return self.proposer.preview(requests, num_tokens)
        except Exception:  # noqa: BLE001 - a failed draft costs speed, never a request
            logger.exception("%s proposer failed while the step was planned; these rows plan no draft",
                             self.proposer.method)  # fmt: skip
            return [[] for _ in requests]

    def _prepare_and_draft(self, rows: list[ScheduledRow]) -> tuple[PreparedStep, DeviceArrays]:
        """Host drafts and the one upload, then a device proposer's drafts (if any).
        A failing draft model or head costs this step its drafts, never a request."""
        plan = self._prepare(rows)
        arrays = plan.buf.upload(self.device)
        draft = plan.draft
        if draft is None:
            return plan, arrays
        proposer = self.proposer
        assert proposer is not None
        try:
            ids, q = proposer.run(draft, arrays)
        except Exception:  # noqa: BLE001 - a failed draft costs speed, never a request
            logger.exception("%s proposer failed; these rows decode plainly this step", proposer.method)
            plan = self._prepare(rows, device_drafting=False)
            return plan, plan.buf.upload(self.device)
        num_verify = len(plan.draft_rows)
        if plan.probe_rows:
            plan.probe_ids = ids[num_verify:, 0]
            plan.probe_q = None if q is None else q[num_verify:, 0]
        if num_verify:
            plan.device_ids = ids[:num_verify]
            plan.device_q = None if q is None else q[:num_verify]
        if proposer.ends_drafts_early(self.device):
            plan = self._as_drafted(plan)
            arrays = plan.buf.upload(self.device)
        return plan, arrays

    def _verified(self, plan: PreparedStep, outputs: dict[str, RowOutput]) -> None:
        """Tell a device proposer what the target kept of its drafts."""
        if self.proposer is None or plan.device_ids is None:
            return
        for i in plan.draft_rows:
            row = plan.rows[i]
            out = outputs.get(row.request_id)
            if out is not None and out.error is None:
                self.proposer.verified(row.request_id, row.start_pos + len(row.token_ids) + out.num_accepted_tokens)

    @staticmethod
    def _step_output(plan: PreparedStep, outputs: dict[str, RowOutput], phases: dict[str, float]) -> StepOutput:
        accepted_per_position = [0] * max(plan.num_draft)
        for out in outputs.values():
            for j in range(out.num_accepted_tokens):
                accepted_per_position[j] += 1
        return StepOutput(
            rows=[outputs.get(row.request_id) or RowOutput(row.request_id) for row in plan.rows],
            num_draft_rows=plan.draft.num_computed if plan.draft is not None else 0,
            num_draft_catch_up=plan.draft.num_catch_up if plan.draft is not None else 0,
            phase_seconds=phases,
            accepted_per_position=accepted_per_position,
            grammar_mask_seconds=plan.grammar_mask_seconds,
            grammar_cut_tokens=plan.grammar_cut_tokens,
        )

    # -- prepare: host-side drafting and the step's one upload --
    def _prepare(self, rows: list[ScheduledRow], device_drafting: bool = True) -> PreparedStep:
        host_drafts, draft_rows, grammar_cut = self.host.for_step(rows, device_drafting)
        num_draft = [len(d.token_ids) if d else 0 for d in host_drafts]
        methods = [d.method if d else None for d in host_drafts]
        proposer = self.proposer if self.on_device and device_drafting else None
        for i in draft_rows:
            assert proposer is not None
            num_draft[i] = rows[i].num_spec_tokens
            methods[i] = proposer.method
        probe_rows = []
        if proposer is not None:
            probe_rows = [
                i
                for i, row in enumerate(rows)
                if row.probe and row.sample and not num_draft[i] and row.request.constraint is None
            ]
        plan = PreparedStep(
            rows=rows,
            host_drafts=host_drafts,
            num_draft=num_draft,
            methods=methods,
            draft=None,
            draft_rows=draft_rows,
            layout=self._layout(rows, num_draft),
            sample_rows=[i for i, row in enumerate(rows) if row.sample],
            shadows=self.host.shadows(rows),
            probe_rows=probe_rows,
            grammar_cut_tokens=grammar_cut,
        )
        if draft_rows or probe_rows:
            assert proposer is not None
            try:  # probes ride in the same forwards, after the rows that verify
                plan.draft = proposer.plan(
                    [rows[i].request for i in draft_rows + probe_rows],
                    [num_draft[i] for i in draft_rows] + [1] * len(probe_rows),
                    plan.buf,
                )
            except Exception:  # noqa: BLE001 - a failed draft costs speed, never a request
                logger.exception("%s proposer failed; these rows decode plainly this step", proposer.method)
                return self._prepare(rows, device_drafting=False)
        if plan.draft is None or proposer is None or not proposer.ends_drafts_early(self.device):
            self._plan_target(plan, plan.draft.k_max if plan.draft else 0)
        return plan  # else the target's part waits for the drafts' lengths (`_prepare_and_draft`)

    def _layout(self, rows: list[ScheduledRow], num_draft: list[int]) -> LayoutPlan:
        lens = [len(row.token_ids) + k for row, k in zip(rows, num_draft)]
        block_tables = [r.block_ids for r in rows]
        return LayoutPlan.build(
            block_tables, [r.start_pos for r in rows], lens, self.config.block_size, self.target.paged_limits
        )

    def _as_drafted(self, plan: PreparedStep) -> PreparedStep:
        """The step for the drafts as the device proposer made them (`DraftPlan.num_drafted`: some
        may have ended early), its target's part in a buffer of its own: the target verifies
        only the tokens drafted."""
        assert plan.draft is not None and plan.draft.num_drafted is not None
        num_draft = list(plan.num_draft)
        for i, n in zip(plan.draft_rows, plan.draft.num_drafted):
            num_draft[i] = n
        k = max((num_draft[i] for i in plan.draft_rows), default=0)
        ids, q = plan.device_ids, plan.device_q
        drafted = replace(
            plan,
            num_draft=num_draft,
            layout=plan.layout if num_draft == plan.num_draft else self._layout(plan.rows, num_draft),
            buf=HostBuffer(),
            device_ids=None if ids is None else ids[:, :k],
            device_q=None if q is None else q[:, :k],
        )
        self._plan_target(drafted, k)
        return drafted

    def _plan_target(self, plan: PreparedStep, k_max: int) -> None:
        """The target's part of the upload: its layout, the packed input (device drafts as
        placeholders, filled from rows of `k_max` drafted ids) and the sampling."""
        rows, num_draft, draft_rows, buf = plan.rows, plan.num_draft, plan.draft_rows, plan.buf
        plan.layout.add_to(buf, "layout")
        input_ids: list[int] = []
        keep: list[int] = []
        fill_pos: list[int] = []
        fill_src: list[int] = []
        draft_index = {row: d for d, row in enumerate(draft_rows)}
        for i, row in enumerate(rows):
            first_draft = len(input_ids) + len(row.token_ids)
            input_ids += row.token_ids
            if i in draft_index:
                fill_pos += range(first_draft, first_draft + num_draft[i])
                fill_src += range(draft_index[i] * k_max, draft_index[i] * k_max + num_draft[i])
                input_ids += [0] * num_draft[i]  # placeholders: the drafts are on the device
            elif (draft := plan.host_drafts[i]) is not None:
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

    def _plan_sampling(self, plan: PreparedStep) -> None:
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
        self._plan_grammar_masks(plan)
        plan_penalty_counts(requests, buf, "counts")
        nan_rows = [r for r, i in enumerate(plan.sample_rows) if self._maybe_inject_fault(rows[i], "nan")]
        if nan_rows:
            buf.ints("nan_rows", nan_rows)

    def _plan_grammar_masks(self, plan: PreparedStep) -> None:
        """The token bitmask of every kept logit of a row under a grammar: at its next token and
        after each of its drafts (which its grammar allows: `HostDrafts.for_step` cut them)."""
        items: list[tuple[GrammarState, int, list[int]]] = []
        rows: list[int] = []
        kept = 0  # the row's first kept logit
        for i in plan.sample_rows:
            n = plan.num_draft[i] + 1
            constraint = plan.rows[i].request.constraint
            if constraint is not None:
                assert isinstance(constraint, GrammarState)
                draft = plan.host_drafts[i]
                items.append((constraint, len(rows), draft.token_ids if draft is not None else []))
                rows += range(kept, kept + n)
            kept += n
        if not items:
            return
        start = time.perf_counter()
        bitmask = fill_masks(items, len(rows), parallel=self.device.type != "cpu")
        plan.grammar_mask_seconds = time.perf_counter() - start
        plan.buf.ints("grammar.rows", rows)
        plan.buf.ints("grammar.masks", bitmask)
        plan.grammar_words = bitmask.shape[1]

    # -- forward --
    def _forward(self, plan: PreparedStep, arrays: DeviceArrays) -> torch.Tensor:
        input_ids = arrays["input_ids"]
        if plan.device_ids is not None:
            input_ids = input_ids.clone()
            input_ids[arrays["fill_pos"]] = plan.device_ids.reshape(-1)[arrays["fill_src"]]
        layout = plan.layout.resolve(arrays, "layout")
        proposer = self.proposer
        if proposer is None or not proposer.uses_features:
            # [len(keep), V] in the model's dtype: `sample_step` converts where it samples.
            return forward_step(self.target.model, self.cache, layout, input_ids, arrays["keep"], float_logits=False)
        # Every token's features, at its KV row: positions < num_computed_tokens then always hold
        # accepted tokens' (drafts the verify rejects are overwritten later, like their KV).
        logits, hidden = forward_with_hidden(
            self.target.model, self.cache, layout, input_ids, arrays["keep"], proposer.feature_layers
        )
        proposer.store_features(layout.token_dest, hidden)
        return logits

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


def _forward_phase(plan: PreparedStep) -> str:
    if any(row.request.is_prefilling for row in plan.rows):
        return "prefill"
    return "verify" if plan.any_draft else "decode"
