"""ModelRunner: executes one scheduled `Batch` as one target forward.

Per step: proposers draft for the speculating rows, every row's new tokens
(prefill chunk, last token, or last token + drafts) go through the target in
one packed forward, and one rejection-sampling call turns the logits into
1..K+1 tokens per sampling row. Plain rows are the k = 0 case, and a step with
no drafts takes the plain sampling path with no speculative work at all.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from models.forward import packed_forward
from models.kv_cache import ATTN_IMPLEMENTATION, KVCache
from models.loader import LoadedModel
from models.proposers import Draft, PredictionProposer, Proposer
from models.rejection import greedy_verify, rejection_sample
from models.sampling import (
    STREAM_ACCEPT,
    STREAM_SAMPLE,
    SamplingTensors,
    build_token_counts,
    compute_logprobs,
    greedy_ids,
    process_logits,
    sample_from_probs,
    uniform_noise,
)
from scheduler.types import Batch, RowOutput, ScheduledRow, StepOutput

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
    # Test-only: honour SamplingParams.fault ("raise" | "nan") to inject faults.
    enable_fault_injection: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2")


class ModelRunner:
    def __init__(
        self,
        target: LoadedModel,
        config: RunnerConfig,
        proposer: Proposer | None = None,
    ):
        self.target = target
        self.config = config
        self.proposer = proposer
        self.prediction = PredictionProposer()
        self.device = target.device
        self.vocab_size = target.vocab_size
        target.model.set_attn_implementation(ATTN_IMPLEMENTATION)
        self.cache = KVCache.for_model(
            target.model.config, config.max_num_seqs, config.max_model_len, target.dtype, target.device
        )
        logger.info(
            "KV cache: %d slots x %d tokens, %.1f MiB",
            config.max_num_seqs,
            config.max_model_len,
            self.cache.num_bytes / 2**20,
        )

    @property
    def proposer_name(self) -> str:
        return self.proposer.method if self.proposer else "none"

    def free(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if self.proposer:
                self.proposer.free(request_id)

    @torch.inference_mode()
    def execute(self, batch: Batch) -> StepOutput:
        self.free(batch.finished_ids)
        rows = batch.rows
        phases: dict[str, float] = {}
        for row in rows:
            self._maybe_inject_fault(row, "raise")

        t0 = time.perf_counter()
        drafts = self._propose(rows)
        if any(drafts):
            phases["draft"] = time.perf_counter() - t0

        token_lists = [row.token_ids + (d.token_ids if d else []) for row, d in zip(rows, drafts)]
        sample_rows = [i for i, row in enumerate(rows) if row.sample]
        keep, offset = [], 0
        for i, tokens in enumerate(token_lists):
            offset += len(tokens)
            if rows[i].sample:
                n = len(drafts[i].token_ids) + 1 if drafts[i] else 1
                keep += range(offset - n, offset)

        t1 = time.perf_counter()
        logits = packed_forward(
            self.target.model,
            self.cache,
            [row.slot for row in rows],
            [row.start_pos for row in rows],
            token_lists,
            keep,
        )  # [len(keep), vocab]
        outputs = {row.request_id: RowOutput(row.request_id) for row in rows}
        accepted_per_position: list[int] = []
        if sample_rows:
            self._sample(rows, sample_rows, drafts, logits, outputs, accepted_per_position)
        forward_phase = (
            "prefill" if any(r.request.is_prefilling for r in rows) else "verify" if any(drafts) else "decode"
        )
        phases[forward_phase] = time.perf_counter() - t1
        return StepOutput(
            rows=[outputs[row.request_id] for row in rows],
            phase_seconds=phases,
            accepted_per_position=accepted_per_position,
        )

    # -- drafting --
    def _propose(self, rows: list[ScheduledRow]) -> list[Draft | None]:
        drafts: list[Draft | None] = [None] * len(rows)
        spec = [i for i, row in enumerate(rows) if row.sample and row.num_spec_tokens > 0]
        with_prediction = [i for i in spec if rows[i].request.prediction_ids]
        plain_spec = [i for i in spec if not rows[i].request.prediction_ids]
        for index, proposer in ((with_prediction, self.prediction), (plain_spec, self.proposer)):
            if not index or proposer is None:
                continue
            try:
                proposed = proposer.propose(
                    [rows[i].request for i in index], [rows[i].num_spec_tokens for i in index]
                )
            except Exception:  # noqa: BLE001 - a failed draft costs speed, never a request
                logger.exception("%s proposer failed; these rows decode plainly this step", proposer.method)
                continue
            for i, draft in zip(index, proposed):
                if draft.token_ids:
                    drafts[i] = draft
        return drafts

    # -- sampling --
    def _sample(
        self,
        rows: list[ScheduledRow],
        sample_rows: list[int],
        drafts: list[Draft | None],
        logits: torch.Tensor,
        outputs: dict[str, RowOutput],
        accepted_per_position: list[int],
    ) -> None:
        device = logits.device
        requests = [rows[i].request for i in sample_rows]
        row_drafts = [drafts[i] for i in sample_rows]
        num_draft = [len(d.token_ids) if d else 0 for d in row_drafts]
        n_max = max(num_draft) + 1
        num_rows, vocab = len(sample_rows), logits.shape[-1]

        # Scatter the kept logits into a padded grid: [rows, n_max, vocab].
        if n_max == 1:
            grid = logits[:, None, :]
        else:
            grid = logits.new_zeros(num_rows, n_max, vocab)
            flat = [r * n_max + j for r, k in enumerate(num_draft) for j in range(k + 1)]
            grid.view(-1, vocab)[torch.tensor(flat, device=device)] = logits
        for r, request in enumerate(requests):
            if self._maybe_inject_fault(rows[sample_rows[r]], "nan"):
                grid[r] = float("nan")

        st = SamplingTensors.from_params([req.params for req in requests], vocab, device)
        output_counts = prompt_mask = None
        if not st.no_penalties:
            output_counts = build_token_counts([req.output_ids for req in requests], vocab, device)
            prompt_mask = build_token_counts([req.prompt_ids for req in requests], vocab, device) > 0
        draft_ids = None
        if n_max > 1:
            draft_ids = torch.tensor(
                [(d.token_ids if d else []) + [0] * (n_max - 1 - k) for d, k in zip(row_drafts, num_draft)],
                dtype=torch.long,
                device=device,
            )  # [rows, n_max - 1]
        if st.all_greedy:  # p and q are one-hot: compare argmaxes, no probabilities
            target_ids = greedy_ids(grid, st, output_counts, prompt_mask, draft_ids)  # [rows, n_max]
            if n_max == 1:
                num_accepted, token_ids = torch.zeros(num_rows, dtype=torch.long, device=device), target_ids
            else:
                num_accepted, token_ids = greedy_verify(draft_ids, torch.tensor(num_draft, device=device), target_ids)
        else:
            probs = process_logits(grid, st, output_counts, prompt_mask, draft_ids)  # [rows, n_max, vocab]
            positions = torch.tensor([len(req.output_ids) for req in requests], device=device)[:, None]
            positions = positions + torch.arange(n_max, device=device)  # [rows, n_max]
            u_sample = uniform_noise(st.seeds, positions, STREAM_SAMPLE)
            if n_max == 1:
                num_accepted = torch.zeros(num_rows, dtype=torch.long, device=device)
                token_ids = sample_from_probs(probs, u_sample)  # [rows, 1]
            else:
                u_accept = uniform_noise(st.seeds, positions[:, :-1], STREAM_ACCEPT)
                q = self._draft_probs(row_drafts, num_draft, n_max - 1, vocab, device)
                num_accepted, token_ids = rejection_sample(
                    draft_ids, torch.tensor(num_draft, device=device), q, probs, u_accept, u_sample
                )
        finite = torch.isfinite(grid).flatten(1).all(1)
        # One host sync for the whole step.
        host = torch.cat([finite[:, None].long(), num_accepted[:, None], token_ids], dim=1).tolist()

        want_logprobs = [req.params.logprobs is not None for req in requests]
        emitted: list[list[int]] = []
        for r, (request, (is_finite, n_acc, *ids)) in enumerate(zip(requests, host)):
            out = outputs[request.request_id]
            if not is_finite:
                out.error = "the model produced non-finite logits for this request"
                emitted.append([])
                continue
            out.token_ids = ids[: n_acc + 1]
            emitted.append(out.token_ids)
            if row_drafts[r]:
                out.method = row_drafts[r].method
                out.num_draft_tokens = num_draft[r]
                out.num_accepted_tokens = n_acc
                while len(accepted_per_position) < num_draft[r]:
                    accepted_per_position.append(0)
                for pos in range(n_acc):
                    accepted_per_position[pos] += 1
        if any(want_logprobs):
            self._attach_logprobs(grid, requests, emitted, outputs)

    def _draft_probs(self, row_drafts, num_draft, k_max, vocab, device) -> torch.Tensor | None:
        """q for the rejection sampler: the draft model's probabilities, or one-hot rows."""
        if not any(d is not None and d.probs is not None for d in row_drafts):
            return None
        q = torch.zeros(len(row_drafts), k_max, vocab, device=device)
        for r, (draft, k) in enumerate(zip(row_drafts, num_draft)):
            if draft is None:
                continue
            if draft.probs is not None:
                width = min(vocab, draft.probs.shape[-1])
                q[r, :k, :width] = draft.probs[:k, :width]
            else:
                q[r, torch.arange(k), torch.tensor(draft.token_ids)] = 1.0
        return q

    def _attach_logprobs(self, grid, requests, emitted, outputs) -> None:
        """Log-probabilities of the raw target distribution at each emitted position."""
        index = [(r, j) for r, ids in enumerate(emitted) for j in range(len(ids))]
        if not index:
            return
        rows_t = torch.tensor([r for r, _ in index], device=grid.device)
        pos_t = torch.tensor([j for _, j in index], device=grid.device)
        chosen = torch.tensor([emitted[r][j] for r, j in index], device=grid.device)
        top_n = max(req.params.logprobs or 0 for req in requests)
        chosen_lp, top_ids, top_lp = compute_logprobs(grid[rows_t, pos_t], chosen, top_n)
        chosen_lp, top_ids, top_lp = chosen_lp.tolist(), top_ids.tolist(), top_lp.tolist()
        cursor = 0
        for request, ids in zip(requests, emitted):
            n = len(ids)
            if request.params.logprobs is not None and n:
                out = outputs[request.request_id]
                want = request.params.logprobs
                out.logprobs = chosen_lp[cursor : cursor + n]
                out.top_logprobs = [
                    list(zip(top_ids[i][:want], top_lp[i][:want])) for i in range(cursor, cursor + n)
                ]
            cursor += n

    def _maybe_inject_fault(self, row: ScheduledRow, kind: str) -> bool:
        if not self.config.enable_fault_injection or row.request.params.fault != kind:
            return False
        if kind == "raise":
            raise RowFault(row.request_id, "injected fault")
        return True
