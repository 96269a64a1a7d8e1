"""The one /metrics reader: a scrape parsed by prometheus_client, and `wait_idle`."""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


class Metrics:
    """One /metrics scrape (Prometheus text format).

    `families` maps a family name (counters without `_total`) to its parsed
    family; `value(sample_name, **labels)` sums the samples of that name whose
    labels include `labels`, and fails when none does, so a series that
    disappeared can never read as 0.
    """

    def __init__(self, text: str):
        self.families = {family.name: family for family in text_string_to_metric_families(text)}
        self.samples: list[Sample] = [s for family in self.families.values() for s in family.samples]

    @classmethod
    def scrape(cls, url: str, headers: dict[str, str] | None = None, timeout: float = 30) -> Metrics:
        """GET `url`/metrics (`url`: the server's root, without /v1)."""
        response = httpx.get(url + "/metrics", headers=headers, timeout=timeout, trust_env=False)
        response.raise_for_status()
        return cls(response.text)

    def __contains__(self, family: str) -> bool:
        return family in self.families

    def __getitem__(self, family: str):
        return self.families[family]

    def matching(self, name: str, **labels: str) -> list[Sample]:
        """The samples named `name` whose labels include `labels`."""
        return [s for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]

    def value(self, name: str, *, default: float | None = None, **labels: str) -> float:
        """The sum of the matching samples; `default` (or an AssertionError when None) if there are none."""
        found = self.matching(name, **labels)
        if not found:
            if default is None:
                raise AssertionError(f"{name} {labels} not in /metrics")
            return default
        return sum(s.value for s in found)

    def one(self, name: str, **labels: str) -> float:
        """The value of the one matching sample (an AssertionError unless exactly one matches)."""
        found = self.matching(name, **labels)
        assert len(found) == 1, (name, labels, found)
        return found[0].value

    def by_label(self, name: str, label: str) -> dict[str, float]:
        """Samples named `name` summed per value of `label`."""
        totals: dict[str, float] = {}
        for s in self.matching(name):
            key = s.labels.get(label, "")
            totals[key] = totals.get(key, 0.0) + s.value
        return totals


def wait_idle(
    url: str,
    headers: dict[str, str] | None = None,
    timeout: float = 120,
    detail: Callable[[], object] | None = None,
) -> Metrics:
    """Poll `url`/metrics until nothing runs or waits; returns the idle scrape.

    TimeoutError after `timeout` seconds, with `detail()` (e.g. the server's
    probe) in the message. Aborted requests leave at the engine's next step.
    """
    deadline = time.monotonic() + timeout
    while True:
        metrics = Metrics.scrape(url, headers)
        if metrics.value("specd_requests_running") == 0 and metrics.value("specd_requests_waiting") == 0:
            return metrics
        if time.monotonic() > deadline:
            running, waiting = metrics.value("specd_requests_running"), metrics.value("specd_requests_waiting")
            extra = f"; {detail()}" if detail is not None else ""
            raise TimeoutError(f"not idle after {timeout}s: {running:g} running, {waiting:g} waiting{extra}")
        time.sleep(0.1)
