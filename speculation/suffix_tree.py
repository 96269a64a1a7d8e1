"""Suffix trie over token sequences with occurrence counts: the structure behind suffix decoding.

Every suffix of every inserted sequence, cut at `max_depth` tokens, is a path
from the root, and a node's count is how many suffix occurrences reach it.
So the node spelling a context knows how often each token followed it, and
count(child) / continued(node) is the frequency-based probability of that
continuation (occurrences that ended at the node, such as the live context
itself, have no next token and are left out).

A path that only one occurrence takes is not spelled node by node: a leaf
points into that occurrence's sequence and reads its tokens from there, so a
suffix that has become unique costs nothing more as its sequence grows. Nodes
exist only for strings seen at least twice, each owned by an occurrence
passing through it: at most `max_depth` nodes per token held.

Storage is flat: one dict of edges (node * TOKEN_SPACE + token -> child) and
per-node lists of ints. Nothing the tree holds is tracked by Python's cyclic
garbage collector; a node per object made each full collection walk them all
(measured: 12x slower inserts in a process that has torch loaded).

Work (counted in `work`, which tests assert on): appending a token steps every
suffix of the sequence that still sits on a node, at most `max_depth` of them;
removing a sequence walks each of its suffixes once; a `Matcher` advances at
most `max_depth` cursors per token and re-walks at most `max_depth` suffixes
when the tree changed under it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

TOKEN_SPACE = 1 << 32  # edge key: node * TOKEN_SPACE + token
_START_BITS = 32  # a leaf is ~(sequence << _START_BITS | start): negative, unlike node ids
_START_MASK = (1 << _START_BITS) - 1
NONE = -1  # no best child known

# Where a context's suffix sits: its deepest node, the leaf it runs inside (0: none; leaves
# are negative), and how many tokens it matched.
Cursor = tuple[int, int, int]


@dataclass
class Sequence:
    """A sequence being inserted, and its suffixes that still sit on nodes (deepest first)."""

    id: int
    active: list[int] = field(default_factory=list)


class SuffixTree:
    """Counts of every substring of up to `max_depth` tokens of the sequences inserted.

    At most one sequence grows at a time (`extend`); the others are complete.
    `version` changes with every change, so a `Matcher` knows when to re-walk.
    After a removal a node's best child may be stale (a count went down) or
    unknown until the next occurrence through it (the best one went).
    """

    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError("max_depth must be >= 1")
        self.max_depth = max_depth
        self.edges: dict[int, int] = {}  # child: node id >= 0, or a leaf < 0
        self.count = [0]  # per node: suffix occurrences that pass through or end here
        self.continued = [0]  # of those, the ones with a next token
        self.depth = [0]
        self.best = [NONE]  # token of the most frequent child
        self.seqs: dict[int, list[int]] = {}
        self._free: list[int] = []
        self._next_seq = 0
        self.num_nodes = 1  # nodes and leaves: what memory holds
        self.version = 0
        self.work = 0

    def new_sequence(self) -> Sequence:
        seq = Sequence(self._next_seq)
        self.seqs[seq.id] = []
        self._next_seq += 1
        return seq

    def add(self, tokens: list[int]) -> int:
        """Insert a complete sequence; returns its id for `remove`."""
        seq = self.new_sequence()
        self.extend(seq, tokens)
        return seq.id

    def tokens(self, seq: Sequence) -> list[int]:
        return self.seqs[seq.id]

    def extend(self, seq: Sequence, new_tokens: list[int]) -> None:
        """Append tokens to `seq`, adding the suffixes they end: O(max_depth) per token."""
        tokens, edges, cap = self.seqs[seq.id], self.edges, self.max_depth
        count, continued, depth, best = self.count, self.continued, self.depth, self.best
        leaf_base = seq.id << _START_BITS
        self.version += 1
        for token in new_tokens:
            tokens.append(token)
            end = len(tokens) - 1
            count[0] += 1  # the suffix that starts at this token
            stepped: list[int] = []
            self.work += len(seq.active) + 1
            for node in (*seq.active, 0):
                continued[node] += 1
                key = node * TOKEN_SPACE + token
                child = edges.get(key)
                if child is None:  # the suffix is unique from here on
                    edges[key] = ~(leaf_base | (end - depth[node]))
                    self.num_nodes += 1
                    if best[node] == NONE:
                        best[node] = token
                    continue
                if child < 0:
                    child = self._split(node, key, child)
                else:
                    count[child] += 1
                top = best[node]
                if top != token and (top == NONE or self._count(node, top) < count[child]):
                    best[node] = token
                if depth[child] < cap:
                    stepped.append(child)
            seq.active = stepped

    def _count(self, node: int, token: int) -> int:
        child = self.edges[node * TOKEN_SPACE + token]
        return self.count[child] if child >= 0 else 1

    def _new_node(self, depth: int, count: int) -> int:
        self.num_nodes += 1
        if self._free:
            node = self._free.pop()
            self.depth[node], self.count[node], self.continued[node], self.best[node] = depth, count, 0, NONE
            return node
        self.depth.append(depth)
        self.count.append(count)
        self.continued.append(0)
        self.best.append(NONE)
        return len(self.depth) - 1

    def _split(self, parent: int, key: int, leaf: int) -> int:
        """A second occurrence follows `leaf` one token down: spell that token as a node of count 2."""
        node = self._new_node(self.depth[parent] + 1, 2)
        self.edges[key] = node
        seq_tokens, start = self._leaf(leaf)
        follow = start + self.depth[node]
        if self.depth[node] < self.max_depth and follow < len(seq_tokens):
            self.edges[node * TOKEN_SPACE + seq_tokens[follow]] = leaf
            self.continued[node] = 1
            self.best[node] = seq_tokens[follow]
        else:  # the leaf's occurrence ends here (its sequence is complete, or at the depth cap)
            self.num_nodes -= 1
        return node

    def _leaf(self, leaf: int) -> tuple[list[int], int]:
        code = ~leaf
        return self.seqs[code >> _START_BITS], code & _START_MASK

    def remove(self, seq_id: int) -> None:
        """Take a complete sequence out again."""
        tokens, edges, cap = self.seqs[seq_id], self.edges, self.max_depth
        count, continued, best = self.count, self.continued, self.best
        self.version += 1
        for start in range(len(tokens)):
            node = 0
            count[0] -= 1
            for pos in range(start, min(len(tokens), start + cap)):
                self.work += 1
                token = tokens[pos]
                key = node * TOKEN_SPACE + token
                continued[node] -= 1
                child = edges[key]
                if child < 0 or count[child] == 1:  # only this occurrence went this way
                    del edges[key]
                    if best[node] == token:
                        best[node] = NONE
                    self._drop(child, tokens, pos + 1)
                    break
                count[child] -= 1
                node = child
        del self.seqs[seq_id]

    def _drop(self, child: int, tokens: list[int], pos: int) -> None:
        """Free a path only one occurrence (of `tokens`, next token at `pos`) held."""
        while True:
            self.num_nodes -= 1
            if child < 0:
                return
            self._free.append(child)
            if pos >= len(tokens):
                return
            below = self.edges.pop(child * TOKEN_SPACE + tokens[pos], None)
            if below is None:
                return
            child, pos = below, pos + 1
            self.work += 1

    # -- matching a context that lives elsewhere --
    def advance(self, cursor: Cursor, token: int) -> Cursor | None:
        """The cursor one token further, or None when the tree has no such continuation."""
        node, leaf, depth = cursor
        if depth >= self.max_depth:
            return None
        self.work += 1
        if leaf:
            seq_tokens, start = self._leaf(leaf)
            pos = start + depth
            if pos < len(seq_tokens) and seq_tokens[pos] == token:
                return node, leaf, depth + 1
            return None
        child = self.edges.get(node * TOKEN_SPACE + token)
        if child is None:
            return None
        if child < 0:
            return node, child, depth + 1
        return child, 0, depth + 1

    def walk(self, cursor: Cursor, max_tokens: int, min_prob: float) -> tuple[list[int], list[float]]:
        """Follow the most frequent continuation from `cursor`: tokens, and each one's probability
        given the ones before it; stops before the product falls below `min_prob`."""
        node, leaf, depth = cursor
        tokens: list[int] = []
        probs: list[float] = []
        joint = 1.0
        seq_tokens, start = self._leaf(leaf) if leaf else ([], 0)
        while len(tokens) < max_tokens:
            self.work += 1
            if leaf:  # one occurrence: its next token, for sure (even past the depth cap)
                pos = start + depth
                if pos >= len(seq_tokens):
                    break
                tokens.append(seq_tokens[pos])
                probs.append(1.0)
                depth += 1
                continue
            token = self.best[node]
            child = self.edges.get(node * TOKEN_SPACE + token) if token != NONE else None
            if child is None:
                break
            prob = (self.count[child] if child >= 0 else 1) / self.continued[node]
            joint *= prob
            if joint < min_prob:
                break
            tokens.append(token)
            probs.append(prob)
            depth += 1
            if child < 0:
                leaf = child
                seq_tokens, start = self._leaf(leaf)
            else:
                node = child
        return tokens, probs


@dataclass
class Matcher:
    """The suffixes of a growing context (held elsewhere) that occur in `tree`, as cursors (deepest first).

    Advanced with each new token; re-walked from the context's last
    `max_depth` tokens when the tree changed since (a cursor may point at
    nodes that were split or dropped).
    """

    tree: SuffixTree
    cursors: list[Cursor] = field(default_factory=list)
    seen: int = 0  # context tokens the cursors account for
    version: int = -1

    def update(self, context: list[int]) -> list[Cursor]:
        tree = self.tree
        if self.version != tree.version or not self.seen <= len(context) <= self.seen + tree.max_depth:
            self.cursors = []
            self.seen = max(len(context) - tree.max_depth, 0)
        root: Cursor = (0, 0, 0)
        for token in context[self.seen :]:
            self.cursors = [c for c in (tree.advance(c, token) for c in (*self.cursors, root)) if c is not None]
        self.seen = len(context)
        self.version = tree.version
        return self.cursors
