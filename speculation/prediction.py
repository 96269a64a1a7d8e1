"""OpenAI Predicted Outputs: the request's own prediction as its draft, re-synchronised after an edit."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from scheduler.types import Draft, Request
from speculation.proposer import Proposer


class PredictionIndex:
    """Where each bigram of a prediction ends (positions that have a continuation), built once.

    After the output diverges from the prediction, `continuation` re-synchronises on
    the longest tail (2..max_n tokens) of the output that occurs in the prediction,
    latest occurrence first, looking only at the `MAX_CANDIDATES` latest places the
    output's last bigram occurs: O(max_n x candidates) a step whatever the
    prediction's length (a prediction of one repeated token cannot make a step scan
    all of it).
    """

    MAX_CANDIDATES = 64

    def __init__(self, prediction: list[int], max_n: int = 8):
        self.prediction = prediction
        self.max_n = max_n
        self._ends: dict[tuple[int, int], list[int]] = {}
        for end in range(2, len(prediction)):  # end < len: a continuation follows
            self._ends.setdefault((prediction[end - 2], prediction[end - 1]), []).append(end)

    def continuation(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0 or len(tokens) < 2:
            return []
        ends = self._ends.get((tokens[-2], tokens[-1]))
        if not ends:
            return []
        prediction, longest = self.prediction, min(self.max_n, len(tokens))
        best_end, best_n = 0, 0
        for end in reversed(ends[-self.MAX_CANDIDATES :]):  # latest first: ties keep the latest
            n = 2
            while n < longest and end > n and prediction[end - n - 1] == tokens[-n - 1]:
                n += 1
            if n > best_n:
                best_end, best_n = end, n
                if n == longest:
                    break
        return prediction[best_end : best_end + k]


@dataclass
class _PredictionState:
    index: PredictionIndex | None = None  # built at the first divergence
    checked: int = 0  # output tokens compared with the prediction so far
    diverged: bool = False


class PredictionProposer(Proposer):
    """OpenAI Predicted Outputs: the request's `prediction` is the draft.

    While the output still equals a prefix of the prediction, propose the next
    prediction tokens; after a divergence, re-synchronise on the longest n-gram
    of the output's tail that occurs in the prediction (`PredictionIndex`: edits
    in the middle of a predicted file keep paying after the edit). Each step costs
    O(new tokens + max_n), never a rescan of the prediction.
    """

    method = "prediction"

    def __init__(self, max_n: int = 8):
        self.max_n = max_n
        self._state: dict[str, _PredictionState] = {}

    def propose(
        self, requests: Sequence[Request], num_tokens: list[int], pending: Sequence[list[int]] | None = None
    ) -> list[Draft]:
        drafts = []
        for r, (request, k) in enumerate(zip(requests, num_tokens)):
            prediction = request.prediction_ids or []
            out = request.output_ids if pending is None else request.output_ids + pending[r]
            state = self._state.setdefault(request.request_id, _PredictionState())
            if not state.diverged:
                upto = min(len(out), len(prediction))
                state.diverged = (
                    len(out) > len(prediction) or out[state.checked : upto] != prediction[state.checked : upto]
                )
                state.checked = len(out)
            if not state.diverged:
                ids = prediction[len(out) : len(out) + k]
            else:
                if state.index is None:
                    state.index = PredictionIndex(prediction, self.max_n)
                ids = state.index.continuation(out, k)
            drafts.append(Draft(self.method, ids))
        return drafts

    def free(self, request_id: str) -> None:
        self._state.pop(request_id, None)
