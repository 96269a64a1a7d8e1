"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): drafts from what this request and
earlier requests of the same tenant generated, each token with its frequency-based probability.

Each running request has a suffix tree over its prompt and output (extended
with the tokens accepted since its last step); each tenant has one over the
outputs of its finished requests. A draft follows the most frequent
continuation of the longest context suffix found in either tree; each token
carries count(continuation) / count(context), and the draft stops where the
product falls below `min_prob` or past `factor` x the match length (a short
match is weak evidence). The tree whose draft scores higher (sum of the
products, the paper's score) wins.

Isolation: the global trees are keyed by `Request.cache_scope` (its tenant, or its
tenant and `cache_salt`), so one tenant's outputs never reach another's drafts,
and the cache bound evicts from the tenant holding the most outputs, all its
scopes together, so one tenant's traffic cannot push another's outputs out
while it holds more, however many salts it mints.
"""

from __future__ import annotations

import collections.abc
from collections import deque
from dataclasses import dataclass

from scheduler.types import Draft, FinishReason, Request
from speculation.proposer import BuildContext, Proposer
from speculation.suffix_tree import Cursor, Matcher, Sequence, SuffixTree


@dataclass
class SuffixConfig:
    # Finished outputs kept for drafting, all tenants together (0: per-request trees only).
    cache_requests: int = 256
    # Longest substring counted. A match uses at most half of it: the other half holds the
    # statistics of the draft that follows (up to 16 tokens).
    max_depth: int = 32
    min_prob: float = 0.1  # a draft stops before its joint probability falls below this
    factor: float = 1.0  # a draft holds at most factor x match length tokens

    def __post_init__(self) -> None:
        if self.cache_requests < 0:
            raise ValueError("cache_requests must be >= 0")
        if self.max_depth < 2:
            raise ValueError("max_depth must be >= 2")


class SuffixCache:
    """Trees over finished outputs, one per cache scope (a tenant, or a tenant and a salt), at
    most `max_requests` outputs in all.

    Over the bound, the oldest output of the tenant holding the most goes (ties: the tenant
    whose oldest output is oldest), whichever of its scopes holds it: a client that mints a
    fresh salt for every request fills its own tenant's share, never another tenant's.
    """

    def __init__(self, max_depth: int, max_requests: int):
        self.max_depth = max_depth
        self.max_requests = max_requests
        self.trees: dict[str, SuffixTree] = {}  # by cache scope
        # Per tenant, oldest first: (serial, scope, sequence id in that scope's tree).
        self._outputs: dict[str, deque[tuple[int, str, int]]] = {}
        self._per_scope: dict[str, int] = {}  # outputs each scope's tree holds
        self._serial = 0

    def get(self, scope: str) -> SuffixTree | None:
        return self.trees.get(scope)

    def add(self, tenant: str, scope: str, tokens: list[int]) -> None:
        if self.max_requests == 0 or not tokens:
            return
        tree = self.trees.get(scope)
        if tree is None:
            tree = self.trees[scope] = SuffixTree(self.max_depth)
        self._outputs.setdefault(tenant, deque()).append((self._serial, scope, tree.add(tokens)))
        self._per_scope[scope] = self._per_scope.get(scope, 0) + 1
        self._serial += 1
        while self.num_requests > self.max_requests:
            self._evict()

    def _evict(self) -> None:
        tenant = max(self._outputs, key=lambda t: (len(self._outputs[t]), -self._outputs[t][0][0]))
        outputs = self._outputs[tenant]
        _, scope, seq_id = outputs.popleft()
        self.trees[scope].remove(seq_id)
        self._per_scope[scope] -= 1
        if not self._per_scope[scope]:
            del self._per_scope[scope], self.trees[scope]
        if not outputs:
            del self._outputs[tenant]

    @property
    def num_requests(self) -> int:
        return sum(len(q) for q in self._outputs.values())

    @property
    def num_tenants(self) -> int:
        return len(self._outputs)

    @property
    def num_nodes(self) -> int:
        return sum(tree.num_nodes for tree in self.trees.values())


@dataclass
class _Row:
    """A running request's suffix state."""

    request: Request
    tree: SuffixTree  # over its prompt and output
    seq: Sequence
    matcher: Matcher | None = None  # its context's suffixes in its tenant's tree
    cached: tuple[int, int, Draft] | None = None  # (context length, tokens asked, draft)


class SuffixProposer(Proposer):
    method = "suffix"

    def __init__(self, config: SuffixConfig | None = None):
        self.config = config or SuffixConfig()
        self.cache = SuffixCache(self.config.max_depth, self.config.cache_requests)
        self._rows: dict[str, _Row] = {}
        self.work = 0  # tree steps done by propose: what a test can count

    @classmethod
    def build(cls, context: BuildContext) -> SuffixProposer:
        return cls(SuffixConfig(cache_requests=context.config.suffix_cache_requests))

    def propose(
        self,
        requests: collections.abc.Sequence[Request],
        num_tokens: list[int],
        pending: collections.abc.Sequence[list[int]] | None = None,
    ) -> list[Draft]:
        assert pending is None, "suffix decoding drafts for the step in hand, never ahead"
        return [self._propose(self._row(request), k) for request, k in zip(requests, num_tokens)]

    def free(self, request_id: str) -> None:
        """The request left: its output joins its tenant's tree (an error's output does not; a
        preempted request's tree is rebuilt when it runs again, and its output joins when it ends)."""
        row = self._rows.pop(request_id, None)
        if row is not None and row.request.is_finished and row.request.finish_reason is not FinishReason.ERROR:
            self.cache.add(row.request.tenant, row.request.cache_scope, list(row.request.output_ids))

    @property
    def cache_nodes(self) -> int:
        return self.cache.num_nodes

    def summary(self) -> dict:
        return {"cached_requests": self.cache.num_requests, "tenants": self.cache.num_tenants}

    def _row(self, request: Request) -> _Row:
        """The request's state, its tree extended with the tokens accepted since the last call."""
        row = self._rows.get(request.request_id)
        if row is None:
            tree = SuffixTree(self.config.max_depth)
            row = self._rows[request.request_id] = _Row(request, tree, tree.new_sequence())
        seen, num_prompt = len(row.tree.tokens(row.seq)), len(request.prompt_ids)
        before = row.tree.work
        if seen < num_prompt:
            row.tree.extend(row.seq, request.prompt_ids[seen:])
            seen = num_prompt
        row.tree.extend(row.seq, request.output_ids[seen - num_prompt :])
        self.work += row.tree.work - before
        return row

    def _propose(self, row: _Row, k: int) -> Draft:
        context = row.tree.tokens(row.seq)
        if row.cached is not None:
            length, asked, draft = row.cached
            if length == len(context) and k <= asked:  # the policy's preview of this very step
                return Draft(self.method, draft.token_ids[:k], (draft.token_probs or [])[:k])
        best: tuple[float, list[int], list[float]] = (0.0, [], [])
        tenant_tree = self.cache.get(row.request.cache_scope)
        trees = [row.tree] if tenant_tree is None else [row.tree, tenant_tree]
        before = sum(tree.work for tree in trees)
        depth = row.tree.depth
        sources = [(row.tree, [(node, 0, depth[node]) for node in row.seq.active]), *self._global(row, context)]
        for tree, cursors in sources:
            candidate = self._draft(tree, cursors, k)
            if candidate[0] > best[0]:
                best = candidate
        self.work += sum(tree.work for tree in trees) - before
        draft = Draft(self.method, best[1], best[2])
        row.cached = (len(context), k, draft)
        return draft

    def _global(self, row: _Row, context: list[int]) -> list[tuple[SuffixTree, list[Cursor]]]:
        """The tenant's tree and where the request's context suffixes sit in it (none without a tree)."""
        tree = self.cache.get(row.request.cache_scope)
        if tree is None:
            row.matcher = None
            return []
        if row.matcher is None or row.matcher.tree is not tree:
            row.matcher = Matcher(tree)
        return [(tree, row.matcher.update(context))]

    def _draft(self, tree: SuffixTree, cursors: list[Cursor], k: int) -> tuple[float, list[int], list[float]]:
        """The better-scoring draft of two matches: the longest, and the longest that leaves half the
        tree's depth for the draft's own statistics."""
        config = self.config
        longest = cursors[0] if cursors else None
        fitting = next((c for c in cursors if c[2] <= config.max_depth // 2), None)
        best: tuple[float, list[int], list[float]] = (0.0, [], [])
        for cursor in (longest, fitting if fitting is not longest else None):
            if cursor is None:
                continue
            max_tokens = min(k, int(config.factor * cursor[2] + 1e-6))
            tokens, probs = tree.walk(cursor, max_tokens, config.min_prob)
            score, joint = 0.0, 1.0
            for p in probs:
                joint *= p
                score += joint
            if score > best[0]:
                best = (score, tokens, probs)
        return best
