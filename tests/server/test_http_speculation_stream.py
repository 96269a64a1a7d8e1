"""`stream_options.include_speculation`: per-chunk speculation counts, mostly on the cycle model
(whose output the n-gram proposer learns, so accepted drafts are certain with speculation on)."""

from __future__ import annotations

import json
from collections import defaultdict

import httpx
import pytest

CHAT = [{"role": "user", "content": "go"}]
COUNTS = ("tokens", "accepted_tokens", "draft_tokens", "rejected_tokens", "steps", "speculative_steps")


def stream_events(server, path: str, body: dict) -> list[dict]:
    """The JSON events of one SSE response (`[DONE]` left out)."""
    events = []
    with httpx.stream("POST", server.base_url + path, json=body, headers=server.headers, timeout=120) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line.removeprefix("data: ")))
    return events


def speculation_sums(events: list[dict]) -> dict[int, dict[str, int]]:
    """Per choice index: every count summed over the chunks that carry `speculation`."""
    sums: dict[int, dict[str, int]] = defaultdict(lambda: dict.fromkeys(COUNTS, 0))
    for event in events:
        for choice in event["choices"]:
            for name, value in choice.get("speculation", {}).items():
                sums[choice["index"]][name] += value
    return dict(sums)


def chat(speculation: bool | str, **fields) -> dict:
    options = {"include_usage": True, "include_speculation": True}
    return {"model": "cycle", "messages": CHAT, "stream": True, "stream_options": options,
            "speculation": speculation, **fields}  # fmt: skip


def usage_counts(usage: dict) -> tuple[int, int, int]:
    details = usage["completion_tokens_details"]
    return usage["completion_tokens"], details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]


def test_absent_unless_asked(cycle_server):
    body = chat(True, max_tokens=30, stream_options={"include_usage": True})
    events = stream_events(cycle_server, "/chat/completions", body)
    assert events[-1]["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
    assert all("speculation" not in choice for event in events for choice in event["choices"])


def test_every_content_chunk_carries_counts_that_add_up_to_usage(cycle_server):
    events = stream_events(cycle_server, "/chat/completions", chat(True, max_tokens=60))
    opening, *chunks, last = events
    assert "speculation" not in opening["choices"][0] and last["choices"] == []
    assert all(set(c["choices"][0]["speculation"]) == set(COUNTS) for c in chunks)
    sums = speculation_sums(events)[0]
    tokens, accepted, rejected = usage_counts(last["usage"])
    assert (sums["tokens"], sums["accepted_tokens"], sums["rejected_tokens"]) == (tokens, accepted, rejected)
    assert sums["draft_tokens"] == accepted + rejected
    assert accepted > 0 and 0 < sums["speculative_steps"] <= sums["steps"] < tokens  # drafts saved steps
    for chunk in chunks:
        counts = chunk["choices"][0]["speculation"]
        assert counts["accepted_tokens"] <= counts["tokens"]
        assert counts["draft_tokens"] == counts["accepted_tokens"] + counts["rejected_tokens"]


def test_plain_decoding_reports_one_token_per_step_and_no_drafts(cycle_server):
    events = stream_events(cycle_server, "/chat/completions", chat(False, max_tokens=30))
    sums = speculation_sums(events)[0]
    assert sums == {**dict.fromkeys(COUNTS, 0), "tokens": 30, "steps": 30}
    assert usage_counts(events[-1]["usage"]) == (30, 0, 0)


def test_sums_hold_when_a_stop_string_cuts_a_verified_run(cycle_server):
    # "日" is the 7th token of each cycle; a verify step accepts drafts past it, which usage does not count.
    body = chat(True, max_tokens=200, stop=["日é!\nAb😀 日"])
    events = stream_events(cycle_server, "/chat/completions", body)
    sums = speculation_sums(events)[0]
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert (sums["tokens"], sums["accepted_tokens"], sums["rejected_tokens"]) == usage_counts(events[-1]["usage"])


def test_with_a_prediction_the_counts_are_prediction_tokens(cycle_server, cycle_text):
    body = chat(True, max_tokens=28, temperature=0, prediction={"type": "content", "content": cycle_text.chars(16)})
    events = stream_events(cycle_server, "/chat/completions", body)
    sums = speculation_sums(events)[0]
    usage = usage_counts(events[-1]["usage"])
    assert usage[1] > 0 and (sums["tokens"], sums["accepted_tokens"], sums["rejected_tokens"]) == usage


def test_completions_with_several_prompts_and_choices(tiny_server):
    model = httpx.get(tiny_server.base_url + "/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": ["a b a b a b", "Hello"], "n": 2, "max_tokens": 24, "ignore_eos": True,
            "stream": True, "speculation": True, "seed": 7,
            "stream_options": {"include_usage": True, "include_speculation": True}}  # fmt: skip
    # Sampled, so seeded: unseeded, the random model's tokens give the n-gram proposer no
    # match on some runs (a 1-gram match on ~10% of steps), and the assert below fails.
    events = stream_events(tiny_server, "/completions", body)
    sums = speculation_sums(events)
    assert sorted(sums) == [0, 1, 2, 3]
    assert all(s["tokens"] == 24 for s in sums.values())
    assert sums[0]["speculative_steps"] > 0  # the repeating prompt gives the n-gram proposer something to copy
    total = tuple(sum(s[name] for s in sums.values()) for name in ("tokens", "accepted_tokens", "rejected_tokens"))
    assert total == usage_counts(events[-1]["usage"])


@pytest.mark.parametrize("path, body", [
    ("/chat/completions", {"messages": CHAT}),
    ("/completions", {"prompt": "\n"}),
])  # fmt: skip
def test_needs_a_stream(cycle_server, path, body):
    options = {"include_speculation": True}
    response = httpx.post(
        cycle_server.base_url + path,
        json={"model": "cycle", "max_tokens": 4, "stream_options": options, **body},
        headers=cycle_server.headers,
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "stream_options"
