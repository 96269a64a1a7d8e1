"""Suffix decoding: the counted suffix tree against brute force, matching, drafts and their
probabilities, the cross-request cache (tenants, eviction), and work per step."""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import pytest

from scheduler.types import FinishReason, Request, RequestStatus, SamplingParams
from speculation.suffix import SuffixCache, SuffixConfig, SuffixProposer
from speculation.suffix_tree import TOKEN_SPACE, Matcher, SuffixTree


def substring_counts(seqs: list[list[int]], depth: int) -> Counter:
    counts: Counter = Counter()
    for s in seqs:
        for i in range(len(s)):
            for n in range(1, min(depth, len(s) - i) + 1):
                counts[tuple(s[i : i + n])] += 1
    return counts


def tree_counts(tree: SuffixTree) -> Counter:
    """Every path's count as the tree stores it (leaves read out to the depth cap); checks
    `continued` and `num_nodes` on the way."""
    children = defaultdict(list)
    for key, child in tree.edges.items():
        children[key // TOKEN_SPACE].append((key % TOKEN_SPACE, child))
    counts: Counter = Counter()
    num_nodes = 1
    stack: list[tuple[int, list[int]]] = [(0, [])]
    while stack:
        node, path = stack.pop()
        kids = children[node]
        assert tree.continued[node] == sum(tree.count[c] if c >= 0 else 1 for _, c in kids)
        for token, child in kids:
            num_nodes += 1
            spelled = path + [token]
            if child >= 0:
                counts[tuple(spelled)] += tree.count[child]
                stack.append((child, spelled))
                continue
            tokens, start = tree._leaf(child)
            counts[tuple(spelled)] += 1
            while len(spelled) < tree.max_depth and start + len(spelled) < len(tokens):
                spelled = spelled + [tokens[start + len(spelled)]]
                counts[tuple(spelled)] += 1
    assert num_nodes == tree.num_nodes
    return counts


@pytest.mark.parametrize("seed", range(40))
def test_tree_counts_every_substring_through_inserts_growth_and_removal(seed):
    rng = random.Random(seed)
    depth = rng.randint(2, 8)
    seqs = [[rng.randint(0, 3) for _ in range(rng.randint(1, 40))] for _ in range(4)]
    tree = SuffixTree(depth)
    ids = [tree.add(s) for s in seqs[:3]]
    live = tree.new_sequence()
    for token in seqs[3]:  # one token at a time, as a request grows
        tree.extend(live, [token])
    assert tree_counts(tree) == substring_counts(seqs, depth)
    tree.remove(ids[1])
    assert tree_counts(tree) == substring_counts([seqs[0], seqs[2], seqs[3]], depth)
    empty = SuffixTree(depth)
    for seq_id in [empty.add(s) for s in seqs]:
        empty.remove(seq_id)
    assert empty.num_nodes == 1 and not empty.edges  # nothing leaks


@pytest.mark.parametrize("seed", range(20))
def test_matcher_finds_the_longest_suffix_seen_in_the_tree(seed):
    rng = random.Random(seed)
    depth = 6
    stored = [[rng.randint(0, 2) for _ in range(30)] for _ in range(3)]
    tree = SuffixTree(depth)
    for s in stored:
        tree.add(s)
    seen = substring_counts(stored, depth)
    context: list[int] = []
    matcher = Matcher(tree)
    for _ in range(40):
        context += [rng.randint(0, 2) for _ in range(rng.randint(1, 3))]
        cursors = matcher.update(context)
        lengths = range(1, min(depth, len(context)) + 1)
        longest = max((n for n in lengths if tuple(context[-n:]) in seen), default=0)
        assert (cursors[0][2] if cursors else 0) == longest
        assert [c[2] for c in cursors] == sorted((c[2] for c in cursors), reverse=True)


def request(rid: str, prompt: list[int], output: list[int] = (), tenant: str = "") -> Request:
    r = Request(rid, list(prompt), SamplingParams(max_tokens=4096), tenant=tenant)
    r.output_ids = list(output)
    return r


def finish(proposer: SuffixProposer, r: Request) -> None:
    r.status, r.finish_reason = RequestStatus.FINISHED, FinishReason.STOP
    proposer.free(r.request_id)


def test_a_preempted_request_leaves_no_output_in_the_tenant_tree_until_it_finishes():
    proposer = SuffixProposer()
    r = request("a", [1, 2, 3], output=[7, 8, 9])
    proposer.propose([r], [4])
    proposer.free(r.request_id)  # preempted: still running later, not finished
    assert proposer.cache.num_requests == 0
    proposer.propose([r], [4])  # runs again: its own tree is rebuilt
    finish(proposer, r)
    assert proposer.cache.num_requests == 1


def test_probabilities_are_continuation_frequencies():
    proposer = SuffixProposer(SuffixConfig(min_prob=0.0))
    for i, tail in enumerate([7, 7, 7, 8]):  # after 1 2 3: 7 three times, 8 once
        r = request(f"old{i}", [50 + i], [1, 2, 3, tail, 9])
        proposer.propose([r], [4])
        finish(proposer, r)
    (draft,) = proposer.propose([request("new", [60], [1, 2, 3])], [4])
    assert draft.token_ids == [7, 9]  # then every earlier output ended
    assert draft.token_probs == [0.75, 1.0]


def test_draft_stops_at_the_probability_floor_and_the_match_length():
    proposer = SuffixProposer(SuffixConfig(min_prob=0.3))
    for i, tail in enumerate([7, 8, 9, 7]):  # 7 with frequency 1/2, then unique
        r = request(f"old{i}", [50 + i], [1, 2, 3, tail, 10, 11, 12, 13])
        proposer.propose([r], [8])
        finish(proposer, r)
    (draft,) = proposer.propose([request("a", [60], [1, 2, 3])], [8])
    assert draft.token_ids == [7, 10, 11]  # 3 tokens matched: at most 3 drafted
    proposer = SuffixProposer(SuffixConfig(min_prob=0.6))
    for i, tail in enumerate([7, 8, 9, 7]):
        r = request(f"old{i}", [50 + i], [1, 2, 3, tail, 10, 11, 12, 13])
        proposer.propose([r], [8])
        finish(proposer, r)
    (draft,) = proposer.propose([request("b", [60], [1, 2, 3])], [8])
    assert draft.token_ids == []  # 0.5 < 0.6 at the first token


def test_global_tree_drafts_what_only_an_earlier_request_generated():
    proposer = SuffixProposer()
    earlier = request("earlier", [5, 6], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29])
    proposer.propose([earlier], [8])
    (draft,) = proposer.propose([request("before", [9, 9], [20, 21, 22, 23])], [4])
    assert draft.token_ids == []  # still running: not in the cache yet
    finish(proposer, earlier)
    (draft,) = proposer.propose([request("later", [9, 9], [20, 21, 22, 23])], [4])
    assert draft.token_ids == [24, 25, 26, 27] and draft.token_probs == [1.0] * 4


def test_a_tenants_outputs_never_reach_another_tenants_drafts():
    proposer = SuffixProposer()
    rng = random.Random(0)
    secret = [rng.randrange(1000, 2000) for _ in range(40)]
    a = request("a", [1, 2, 3], secret, tenant="alice")
    proposer.propose([a], [8])
    finish(proposer, a)
    for i in range(len(secret) - 1):  # bob replays every prefix of alice's output
        (draft,) = proposer.propose([request(f"b{i}", [1, 2, 3], secret[: i + 1], tenant="bob")], [8])
        assert draft.token_ids == []
        proposer.free(f"b{i}")
    (draft,) = proposer.propose([request("a2", [1, 2, 3], secret[:10], tenant="alice")], [8])
    assert draft.token_ids == secret[10:18]


def test_global_off_keeps_only_the_requests_own_tree():
    proposer = SuffixProposer(SuffixConfig(cache_requests=0))
    r = request("r", [1], [4, 5, 6, 7, 8, 9])
    proposer.propose([r], [4])
    finish(proposer, r)
    assert proposer.cache_nodes == 0
    (draft,) = proposer.propose([request("s", [1], [4, 5, 6])], [4])
    assert draft.token_ids == []
    (own,) = proposer.propose([request("t", [4, 5, 6, 7, 8, 9, 3], [4, 5, 6])], [4])
    assert own.token_ids == [7, 8, 9]  # the request's own prompt still drafts


def test_eviction_keeps_the_cache_within_its_bound():
    rng = random.Random(1)
    bound, depth = 8, 16
    cache = SuffixCache(depth, bound)
    held: list[list[int]] = []
    for _ in range(60):
        tokens = [rng.randrange(50) for _ in range(rng.randint(10, 80))]
        cache.add("t", "t", tokens)
        held = (held + [tokens])[-bound:]  # FIFO within the tenant
        assert cache.num_requests <= bound
        assert cache.num_nodes <= 1 + depth * sum(len(t) for t in held)
    assert tree_counts(cache.trees["t"]) == substring_counts(held, depth)


def test_eviction_takes_from_the_tenant_holding_the_most():
    cache = SuffixCache(8, 4)
    cache.add("quiet", "quiet", [1, 2, 3])
    for i in range(10):
        cache.add("loud", "loud", [10 + i, 11 + i, 12 + i])
    assert cache.num_requests == 4
    assert "quiet" in cache.trees  # the flood evicted only its own outputs


def test_a_tenant_minting_fresh_salts_evicts_only_its_own_outputs():
    cache = SuffixCache(8, 4)
    cache.add("quiet", "quiet", [1, 2, 3])
    cache.add("quiet", "quiet\x00team", [4, 5, 6])
    for i in range(10):  # every request its own salt: a scope of one output each
        cache.add("loud", f"loud\x00salt-{i}", [10 + i, 11 + i, 12 + i])
    assert cache.num_requests == 4 and cache.num_tenants == 2
    assert {"quiet", "quiet\x00team"} <= set(cache.trees)  # the flood evicted only its own outputs
    assert sum(scope.startswith("loud") for scope in cache.trees) == 2


def test_propose_work_is_bounded_by_new_tokens_not_context_length():
    """Per step: at most max_depth tree steps per new token per tree, plus a few walks of k."""
    config = SuffixConfig()
    k, new = 10, 3
    rng = random.Random(2)
    corpus = [rng.randrange(300) for _ in range(500)]

    def text(n: int) -> list[int]:  # repetitive, so many suffixes stay on nodes
        out: list[int] = []
        while len(out) < n:
            start = rng.randrange(len(corpus) - 60)
            out += corpus[start : start + 60]
        return out[:n]

    for context in (1024, 8192):
        proposer = SuffixProposer(config)
        earlier = request("earlier", [0], text(400))
        proposer.propose([earlier], [k])
        finish(proposer, earlier)
        r = request("r", text(context))
        work = proposer.work
        proposer.propose([r], [k])
        assert proposer.work - work <= config.max_depth * (context + 1) + 4 * (k + 1) + config.max_depth**2
        follow = text(new * 100)
        for step in range(100):
            r.output_ids += follow[step * new : (step + 1) * new]
            work = proposer.work
            proposer.propose([r], [k])
            assert proposer.work - work <= 2 * config.max_depth * new + 4 * (k + 1)


def test_the_planned_draft_is_reused_by_the_step():
    proposer = SuffixProposer()
    r = request("r", [1, 2, 3, 4, 5, 6, 1, 2, 3])
    (planned,) = proposer.propose([r], [6])
    work = proposer.work
    (step,) = proposer.propose([r], [2])
    assert proposer.work == work
    assert step.token_ids == planned.token_ids[:2] == [4, 5]
