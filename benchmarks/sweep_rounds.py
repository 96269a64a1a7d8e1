"""Compare builds over alternating rounds of one `serve_bench` sweep: medians, not single runs.

    python -m benchmarks.sweep_rounds DIR --baseline before

Two runs of one build on a 2-core CPU differed by up to 38% per row, so a
before/after claim needs several runs of each, interleaved in time (round 1
before, round 1 after, round 2 before, ...; benchmarks/results/paging/README.md
has the loop that does that). DIR holds one `serve_bench` output directory per run, named
`<build>-<round>`. Prints a markdown table: per (mode, load), each build's
median output tok/s with its runs, and each build's median over the baseline's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

MODES = ("off", "on", "auto")


def collect(root: Path) -> dict[tuple[str, int], dict[str, list[float]]]:
    """(mode, load) -> build -> output tok/s of each round."""
    runs: dict[tuple[str, int], dict[str, list[float]]] = {}
    for result in sorted(root.glob("*-*/serve_bench.json")):
        build = result.parent.name.rsplit("-", 1)[0]
        for run in json.loads(result.read_text())["runs"]:
            runs.setdefault((run["mode"], run["load"]), {}).setdefault(build, []).append(run["output_throughput"])
    return runs


def render(runs: dict[tuple[str, int], dict[str, list[float]]], baseline: str) -> str:
    builds = sorted({b for per_build in runs.values() for b in per_build}, key=lambda b: (b != baseline, b))
    others = [b for b in builds if b != baseline]
    header = ["mode", "load", *(f"{b} tok/s (runs)" for b in builds), *(f"{b} / {baseline}" for b in others)]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    order = sorted(runs, key=lambda key: (key[1], MODES.index(key[0]) if key[0] in MODES else len(MODES), key[0]))
    for mode, load in order:
        per_build = runs[(mode, load)]
        cells = [mode, str(load)]
        for b in builds:
            values = per_build.get(b, [])
            runs_text = " / ".join(f"{v:.1f}" for v in values)
            cells.append(f"{statistics.median(values):.1f} ({runs_text})" if values else "-")
        base = per_build.get(baseline)
        for b in others:
            values = per_build.get(b)
            ratio = statistics.median(values) / statistics.median(base) if values and base else None
            cells.append(f"{ratio:.2f}" if ratio is not None else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("root", type=Path, help="directory of <build>-<round> serve_bench outputs")
    parser.add_argument("--baseline", default="before", help="the build the others are divided by [before]")
    args = parser.parse_args()
    print(render(collect(args.root), args.baseline))


if __name__ == "__main__":
    main()
