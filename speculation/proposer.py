"""The proposer interface: one base class whose hooks all have defaults, and the policy's view of it.

A proposer overrides what it does and nothing else:

- **Drafting on the host** (n-gram, Predicted Outputs, suffix decoding): `propose`, and
  `preview` where its drafts are priced (its `Capabilities` say which).
- **Drafting on the device** (a draft model, an EAGLE head): `plan` adds what its forwards
  need to the step's one upload, `run` makes the drafts on the device, `verified` hears
  what the target kept. `speculation.device_draft.DeviceProposer` implements the three
  around a subclass's forwards.
- **Memory:** `bytes_per_block` and `allocate` size and make its per-block state (its own
  KV, a head's features) beside the target's KV pool; `uses_features` / `store_features`
  take the target's hidden states from the target's forward.
- **What it keeps:** `free` when a request leaves, `cache_nodes` for what it keeps across
  requests (a metric), `info` for GET /v1/speculation.

`build` makes one from the target and the `ProposerConfig`; `speculation.registry` names
every class. The runner and the policy read only this interface and the capabilities, never
a proposer's kind.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from scheduler.types import Draft, Request
from speculation import registry
from speculation.registry import Capabilities

if TYPE_CHECKING:
    import torch

    from models.loader import LoadedModel, ModelConfig
    from models.transfer import DeviceArrays, HostBuffer
    from speculation.config import ProposerConfig
    from speculation.device_draft import DraftPlan

# Lengths of the drafts (at most k tokens each) a host proposer would make now for these requests.
DraftLengths = Callable[[list[Request], list[int]], list[int]]
# Per-token probabilities of the drafts a priced proposer would make now (at most k tokens each).
Preview = Callable[[list[Request], list[int]], list[list[float]]]


@dataclass(frozen=True)
class Drafting:
    """A runner's drafting as the scheduler sees it: the proposer, what it measured of itself,
    and the questions the policy may ask it while it plans a step (None: cannot answer)."""

    method: str = registry.NONE  # a registry name, or "none"
    prior_rates: tuple[float, ...] = ()  # per draft position, its own acceptance record (an EAGLE head's)
    preview: Preview | None = None  # priced proposers: the drafts' token probabilities
    lookup: DraftLengths | None = None  # beside a device proposer: prompt-lookup drafts' lengths
    available: DraftLengths | None = None  # drafts made ahead (n-gram, Predicted Outputs): their lengths
    catch_up: DraftLengths | None = None  # a device proposer: tokens its first forward would feed each row
    forward_cost_ratio: float | None = None  # a device proposer's (`Proposer.forward_cost_ratio`)
    recurring_feed: int | None = None  # a device proposer's (`Proposer.recurring_feed`)
    info: dict | None = None  # what the proposer shows of itself (an EAGLE head: path, vocabulary, record)

    @property
    def capabilities(self) -> Capabilities:
        return registry.capabilities(self.method)


@dataclass(frozen=True)
class BuildContext:
    """What a proposer is built from: the target, how it was loaded (a draft model loads alike),
    and the proposer's options."""

    target: LoadedModel
    loaded_as: ModelConfig
    config: ProposerConfig


class Proposer:
    method: ClassVar[str]  # its `speculation.registry` name
    # It drafts from the target's hidden states (`store_features`), of these layers (None: the last).
    uses_features: ClassVar[bool] = False
    feature_layers: list[int] | None = None

    @classmethod
    def build(cls, context: BuildContext) -> Proposer:
        """A proposer for `context.target` (loading what it drafts with)."""
        return cls()

    @property
    def capabilities(self) -> Capabilities:
        return registry.capabilities(self.method)

    def ends_drafts_early(self, device: torch.device) -> bool:
        """Whether `run` may end rows' drafts before their k on `device` (`DraftPlan.num_drafted`),
        so the runner plans the target's part of a step once the drafts are made."""
        return False

    # -- drafting on the host --
    def propose(
        self, requests: Sequence[Request], num_tokens: list[int], pending: Sequence[list[int]] | None = None
    ) -> list[Draft]:
        """A draft of at most k tokens per request. `pending`: per request, tokens the step in
        flight emitted that the request does not hold yet (a draft made ahead for them)."""
        return [Draft(self.method, []) for _ in requests]

    def preview(self, requests: list[Request], num_tokens: list[int]) -> list[list[float]]:
        """Per-token probabilities of the drafts it would make now, for the policy to price
        (priced proposers keep each draft for the step that follows)."""
        return [draft.token_probs or [] for draft in self.propose(requests, num_tokens)]

    # -- drafting on the device --
    def plan(self, requests: list[Request], num_tokens: list[int], buf: HostBuffer) -> DraftPlan:
        """Add what this step's draft forwards need to the step's one upload."""
        raise NotImplementedError(f"{self.method} drafts on the host")

    def run(self, plan: DraftPlan, arrays: DeviceArrays) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The drafts, on the device: token ids `[R, k_max]` and q `[R, k_max, V]` (None: all greedy)."""
        raise NotImplementedError(f"{self.method} drafts on the host")

    def feed_lengths(self, requests: list[Request], num_tokens: list[int]) -> list[int]:
        """Tokens the first draft forward would feed each request now (its catch-up)."""
        raise NotImplementedError(f"{self.method} drafts on the host")

    @property
    def forward_cost_ratio(self) -> float | None:
        """What one of its forwards costs against a target forward over as many token rows: the
        weights they multiply by, its over the target's. The policy prices its forwards so until
        steps have measured them (None: it runs none)."""
        return None

    @property
    def recurring_feed(self) -> int | None:
        """The most tokens past a row's last one that its first forward feeds again at every
        verify, however long the row ran plain before (None: up to the draft's length, as a head
        re-feeds what it drafted and the target accepted). The rest of a catch-up is paid once."""
        return None

    def verified(self, request_id: str, num_valid: int) -> None:
        """The target kept the request's positions < num_valid: later ones held rejected drafts."""

    # -- memory beside the target's KV pool --
    def bytes_per_block(self, block_size: int) -> int:
        """What one KV block costs it besides the target's KV (its own KV, a head's features)."""
        return 0

    def allocate(self, num_blocks: int, block_size: int) -> None:
        """Make its per-block state, in the target's block layout (the same block ids)."""

    def store_features(self, dest: torch.Tensor, states: torch.Tensor) -> None:
        """Keep the target's `states` of the step's packed tokens at pool rows `dest`."""

    @property
    def prior_rates(self) -> tuple[float, ...]:
        """Its own acceptance record per draft position, where the policy starts its rows (empty: none)."""
        return ()

    # -- what it keeps --
    def free(self, request_id: str) -> None:
        """The request finished or was preempted: drop what is kept for it."""

    @property
    def cache_nodes(self) -> int | None:
        """Entries it keeps across requests (`specd_proposer_cache_nodes`); None: it keeps none."""
        return None

    def info(self) -> dict | None:
        """What GET /v1/speculation shows of it; None: nothing."""
        return None
