"""The proposer registry: config validation, the CLI's choices, the runner's construction,
the policy's reading of capabilities and the metrics' labels all come from it, so a
proposer is one module and one registry line; a toy proposer registered here runs end to end."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from models.loader import ModelConfig, load_model
from scheduler.metrics import MetricsObserver
from scheduler.offline import run_offline
from scheduler.scheduler import SchedulerConfig
from scheduler.types import Draft, Request, SamplingParams
from server.cli import build_parser
from server.config import Settings
from speculation import registry
from speculation.config import ProposerConfig, SpecConfig
from speculation.proposer import BuildContext, Proposer
from speculation.registry import Capabilities, ProposerSpec
from tests.support.metrics import Metrics
from worker.builder import build_runner
from worker.runner import RunnerConfig


class RepeatProposer(Proposer):
    """A toy: drafts the request's last token k times, for the step in hand."""

    method = "repeat"

    def __init__(self, times: int = 0):
        self.calls = 0

    @classmethod
    def build(cls, context: BuildContext) -> RepeatProposer:
        return cls()

    def propose(
        self, requests: Sequence[Request], num_tokens: list[int], pending: Sequence[list[int]] | None = None
    ) -> list[Draft]:
        self.calls += 1
        return [Draft(self.method, [r.all_token_ids[-1]] * k) for r, k in zip(requests, num_tokens)]


@pytest.fixture
def repeat() -> Iterator[ProposerSpec]:
    spec = registry.register(
        ProposerSpec("repeat", f"{__name__}:RepeatProposer", Capabilities(), "the last token again", default_k=3)
    )
    yield spec
    registry.unregister("repeat")


def test_every_registered_proposer_names_its_class():
    for name, spec in registry.REGISTRY.items():
        assert spec.load().method == name
    # Only proposers whose drafts cost nothing to make can grade a plain row with a shadow.
    assert registry.probing_methods() == ["draft_model", "eagle"]
    assert registry.choices() == ["ngram", "suffix", "draft_model", "eagle", "none"]  # prediction is per request
    given = {"draft_head": "dir"}
    assert registry.default_method(given.get) == "eagle" and registry.default_method({}.get) == "ngram"


def test_config_cli_and_metrics_take_a_registered_proposer(repeat):
    assert ProposerConfig("repeat").method == "repeat"
    settings = Settings(draft="repeat")
    assert settings.resolved_draft == "repeat" and settings.resolved_num_speculative_tokens == 3
    args = build_parser().parse_args(["serve", "--draft", "repeat"])
    assert args.draft == "repeat"
    metrics = Metrics(MetricsObserver("m").render()[0].decode())
    assert metrics.one("specd_spec_decode_num_drafts_total", method="repeat") == 0


def test_an_unknown_proposer_is_refused_everywhere():
    with pytest.raises(ValueError, match="--draft must be one of ngram, suffix, draft_model, eagle, none"):
        ProposerConfig("repeat")
    with pytest.raises(ValueError, match="must be one of"):
        Settings(draft="repeat")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--draft", "repeat"])
    with pytest.raises(ValueError, match="--draft draft_model needs --draft-model"):
        ProposerConfig("draft_model")


def test_the_stop_confidence_is_a_probability_below_one():
    """1 would end every draft after its first token whatever K says; the flag's bounds refuse it."""
    assert ProposerConfig(stop_confidence=0.0).stop_confidence == 0.0
    with pytest.raises(ValueError, match="stop_confidence"):
        ProposerConfig(stop_confidence=1.0)
    with pytest.raises(ValueError, match="draft_stop_confidence"):
        Settings(draft_stop_confidence=-0.1)
    assert build_parser().parse_args(["serve", "--draft-stop-confidence", "0.7"]).draft_stop_confidence == 0.7


def test_a_toy_proposer_drafts_through_the_engine_losslessly(repeat, tiny_llama_dir):
    target = load_model(ModelConfig(str(tiny_llama_dir), dtype="float32", device="cpu"))
    config = SchedulerConfig(max_num_seqs=2, max_model_len=128, spec=SpecConfig(num_speculative_tokens=3))

    def generate(method: str, speculation: bool) -> list:
        runner = build_runner(target, RunnerConfig(max_num_seqs=2, max_model_len=128), ProposerConfig(method))
        params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, speculation=speculation)
        requests = [Request(f"r{i}", prompt, params) for i, prompt in enumerate(([5, 6, 7, 7, 7], [9, 10, 11]))]
        return runner, run_offline(runner, config, requests)

    runner, drafted = generate("repeat", True)
    _, plain = generate("none", False)
    assert isinstance(runner.proposer, RepeatProposer) and runner.proposer.calls > 0
    assert runner.drafting.method == "repeat" and runner.drafting.capabilities is repeat.capabilities
    assert all(c.num_draft_tokens > 0 for c in drafted)
    assert [c.token_ids for c in drafted] == [c.token_ids for c in plain]
