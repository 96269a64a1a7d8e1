"""One output sequence's bookkeeping (`server.choices.Choice`), without a server."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from scheduler.types import FinishReason, RequestOutput, SamplingParams
from server.choices import Choice, chunk_encoder, usage_of
from server.protocol import CompletionChoice, CompletionResponse, ResponseHead, StreamOptions
from tests.support.tiny_models import build_tokenizer


class FakeStream:
    def __init__(self):
        self.request = SimpleNamespace(params=SamplingParams(), prediction_ids=None)
        self.aborted = False

    def abort(self):
        self.aborted = True


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def make_choice(tokenizer, stop: list[str], include_speculation: bool = False) -> Choice:
    req = SimpleNamespace(
        stop=stop,
        include_stop_str_in_output=False,
        skip_special_tokens=True,
        stream_options=StreamOptions(include_speculation=include_speculation),
    )
    return Choice(0, FakeStream(), tokenizer, req, prompt_ids=[])


@pytest.mark.parametrize("split", [1, 3, 100], ids=["token-per-step", "three-per-step", "one-verify-run"])
def test_usage_counts_tokens_up_to_the_stop_string_not_past_it(tokenizer, split):
    """A verify step can accept tokens after a stop string: usage counts only the
    tokens up to the one that completed it, however the tokens arrived."""
    before, after = "The quick brown fox", " jumps over the lazy dog."
    ids = tokenizer.encode(before + " STOP" + after, add_special_tokens=False)
    needed = next(n for n in range(1, len(ids) + 1) if "STOP" in tokenizer.decode(ids[:n]))
    assert needed < len(ids) - 3  # the stop string lands well inside the run
    choice = make_choice(tokenizer, ["STOP"])
    shown = ""
    for start in range(0, len(ids), split):
        chunk = ids[start : start + split]
        update = choice.update(RequestOutput("r", chunk, num_output_tokens=start + len(chunk)))
        shown += update.text if update else ""
        if choice.finished:
            break
    assert choice.finish_reason == "stop" and choice.stream.aborted
    assert shown == before + " "
    usage = usage_of([choice], num_prompt_tokens=5)
    assert usage.completion_tokens == needed and usage.total_tokens == 5 + needed


@pytest.mark.parametrize("split", [1, 3, 100], ids=["token-per-step", "three-per-step", "one-verify-run"])
def test_chunk_speculation_adds_up_to_usage_when_a_stop_string_cuts_a_run(tokenizer, split):
    """Steps of `split` tokens, each a verify of `split` drafts of which all but one are accepted:
    the chunks' counts sum to usage, although text is held back and the last step runs past the stop."""
    ids = tokenizer.encode("The quick brown fox STOP jumps over the lazy dog.", add_special_tokens=False)
    choice = make_choice(tokenizer, ["STOP"], include_speculation=True)
    chunks, drafted, accepted, steps = [], 0, 0, 0
    for start in range(0, len(ids), split):
        steps += 1
        new = ids[start : start + split]
        drafted, accepted = drafted + len(new), accepted + len(new) - 1
        out = RequestOutput(
            "r", new, num_output_tokens=start + len(new), num_draft_tokens=drafted, num_accepted_tokens=accepted
        )
        update = choice.update(out)
        if update is not None:
            chunks.append(update.speculation)
        if choice.finished:
            break
    usage = usage_of([choice], num_prompt_tokens=5)
    details = usage.completion_tokens_details
    assert sum(c.tokens for c in chunks) == usage.completion_tokens < len(ids)
    assert sum(c.accepted_tokens for c in chunks) == details.accepted_prediction_tokens
    assert sum(c.rejected_tokens for c in chunks) == details.rejected_prediction_tokens
    assert sum(c.steps for c in chunks) == sum(c.speculative_steps for c in chunks) == steps


def test_speculation_is_left_out_unless_asked(tokenizer):
    choice = make_choice(tokenizer, [])
    update = choice.update(RequestOutput("r", tokenizer.encode("hi", add_special_tokens=False), num_output_tokens=1))
    assert update is not None and update.speculation is None


def test_usage_without_stop_strings_is_the_engine_count(tokenizer):
    choice = make_choice(tokenizer, [])
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    choice.update(RequestOutput("r", ids, finished=True, finish_reason=FinishReason.LENGTH, num_output_tokens=len(ids)))
    assert usage_of([choice], 2).completion_tokens == len(ids)


def test_cached_tokens_count_each_prompt_once_however_many_choices_ran_it(tokenizer):
    req = SimpleNamespace(
        stop=[], include_stop_str_in_output=False, skip_special_tokens=True, stream_options=StreamOptions()
    )
    first, second = [1] * 40, [2] * 40
    choices = [Choice(i, FakeStream(), tokenizer, req, ids) for i, ids in enumerate([first, first, second])]
    for choice, cached in zip(choices, (32, 0, 16)):  # n=2 of the first prompt: one of them hit
        choice.update(RequestOutput("r", [5], finished=True, num_output_tokens=1, num_cached_tokens=cached))
    usage = usage_of(choices, num_prompt_tokens=80)
    assert usage.prompt_tokens_details.cached_tokens == 32 + 16


def test_chunks_repeat_the_response_head_in_openai_field_order():
    head = ResponseHead("cmpl-1", 1700000000, "m", "fp_x")
    encode = chunk_encoder(CompletionResponse, head)
    body = encode([CompletionChoice(index=0, text="hi")], None)
    assert body.startswith(b"data: ") and body.endswith(b"\n\n")
    chunk = json.loads(body[len(b"data: ") :])
    assert list(chunk) == ["id", "object", "created", "model", "system_fingerprint", "choices"]
    assert (chunk["id"], chunk["object"], chunk["created"], chunk["model"], chunk["system_fingerprint"]) == (
        "cmpl-1",
        "text_completion",
        1700000000,
        "m",
        "fp_x",
    )


def test_choices_do_not_import_the_serving_layer():
    """`server.choices` needs a tokenizer and a log record, not the serving context (no import cycle)."""
    code = "import sys, server.choices; sys.exit('server.serving' in sys.modules)"
    root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=root, check=False).returncode == 0
