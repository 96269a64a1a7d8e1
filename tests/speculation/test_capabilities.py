"""The proposer interface: every proposer carries its capability record, and a runner's
`Drafting` offers the policy exactly the questions its proposer can answer."""

from __future__ import annotations

import pytest

from speculation.draft_model import DraftModelProposer
from speculation.eagle import EagleProposer
from speculation.proposers import CAPABILITIES, NgramProposer, PredictionProposer
from speculation.suffix import SuffixProposer
from tests.models.test_runner import make_runner


def test_every_proposer_carries_the_record_of_its_method():
    classes = [NgramProposer, PredictionProposer, SuffixProposer, DraftModelProposer, EagleProposer]
    assert {cls.method for cls in classes} == set(CAPABILITIES)
    for cls in classes:
        assert cls.capabilities is CAPABILITIES[cls.method]
    # Only proposers whose drafts cost nothing to make can grade a plain row with a shadow.
    assert {m for m, c in CAPABILITIES.items() if not c.can_shadow} == {"draft_model", "eagle"}


@pytest.mark.parametrize(
    ("method", "questions"),
    [
        ("ngram", {"available"}),
        ("suffix", {"available", "preview"}),
        ("draft_model", {"available", "lookup"}),
    ],
)
def test_a_runner_offers_the_policy_what_its_proposer_can_answer(tiny_llama_dir, tiny_draft_dir, method, questions):
    runner = make_runner(tiny_llama_dir, method, tiny_draft_dir if method == "draft_model" else None)
    drafting = runner.drafting
    assert drafting.method == method and drafting.capabilities is CAPABILITIES[method]
    offered = {name for name in ("available", "preview", "lookup") if getattr(drafting, name) is not None}
    assert offered == questions
    assert (runner.device_proposer is not None) == CAPABILITIES[method].on_device
    assert (runner.suffix is not None) == CAPABILITIES[method].memory
