"""`server.serving`: what a request's fields become, under the operator's limits, and requests
that are queued but never handed to a response."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from scheduler.stream import RequestStream
from scheduler.types import Request, SamplingParams
from server.errors import BadRequestError
from server.protocol import CompletionRequest
from server.serving import aborted_on_error, sampling_params


def context(**fields) -> SimpleNamespace:
    base = {"enable_fault_injection": False, "max_request_spec_tokens": 16, "forced_speculation": True,
            "vocab_size": 100}  # fmt: skip
    return SimpleNamespace(**base | fields)


def params(ctx: SimpleNamespace, **fields) -> SamplingParams:
    request = CompletionRequest(model="m", prompt="x", **fields)
    return sampling_params(ctx, request, max_tokens=4, logprobs=None, choice=0)  # type: ignore[arg-type]


def test_the_operator_caps_a_requests_draft_length():
    assert params(context(max_request_spec_tokens=4), num_speculative_tokens=4).num_speculative_tokens == 4
    with pytest.raises(BadRequestError, match="at most 4 on this server") as refused:
        params(context(max_request_spec_tokens=4), num_speculative_tokens=5)
    assert refused.value.param == "num_speculative_tokens"


def test_forced_speculation_can_be_turned_into_auto():
    assert params(context(), speculation=True).speculation is True
    assert params(context(forced_speculation=False), speculation=True).speculation == "auto"
    assert params(context(forced_speculation=False), speculation=False).speculation is False


def test_stop_token_ids_outside_the_vocabulary_are_refused():
    assert params(context(), stop_token_ids=[0, 99]).stop_token_ids == [0, 99]
    with pytest.raises(BadRequestError) as refused:
        params(context(), stop_token_ids=[100])
    assert refused.value.param == "stop_token_ids"


def test_streams_queued_but_never_handed_to_a_response_are_aborted_on_any_failure():
    aborted: list[str] = []
    streams = [RequestStream(Request(f"r{i}", [1], SamplingParams()), aborted.append) for i in range(3)]
    with aborted_on_error(streams):
        pass
    assert aborted == []
    with pytest.raises(RuntimeError), aborted_on_error(streams):
        raise RuntimeError("the response could not be built")
    assert aborted == ["r0", "r1", "r2"]


@pytest.mark.parametrize("prompt", [[10**9] * 9, [[1], [10**9] * 9]], ids=["ids", "lists-of-ids"])
def test_a_token_id_prompt_over_the_context_is_refused_by_its_length_before_its_ids_are_read(prompt):
    from server.serving_completions import check_prompt_sizes

    ctx = context(max_model_len=8)  # ids out of the vocabulary: reading them would be the refusal
    with pytest.raises(BadRequestError, match="maximum context length is 8 tokens") as refused:
        check_prompt_sizes(ctx, prompt)  # type: ignore[arg-type]
    assert refused.value.code == "context_length_exceeded" and refused.value.param == "prompt"
    check_prompt_sizes(ctx, [10**9] * 7)  # type: ignore[arg-type]  # fits: the ids are judged later
