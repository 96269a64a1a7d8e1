"""benchmarks.sweep_rounds: medians per build over interleaved rounds, ratios against the baseline."""

import json

from benchmarks.sweep_rounds import collect, render


def _write(root, name, runs):
    out = root / name
    out.mkdir()
    records = [{"mode": m, "load": c, "output_throughput": v} for m, c, v in runs]
    (out / "serve_bench.json").write_text(json.dumps({"meta": {}, "runs": records}))


def test_medians_and_ratio_against_the_baseline(tmp_path):
    for r, (b, a) in enumerate([(10.0, 30.0), (20.0, 12.0), (11.0, 22.0)], start=1):
        _write(tmp_path, f"before-{r}", [("off", 1, b), ("on", 4, 2 * b)])
        _write(tmp_path, f"after-{r}", [("off", 1, a), ("on", 4, a)])
    runs = collect(tmp_path)
    assert runs[("off", 1)] == {"before": [10.0, 20.0, 11.0], "after": [30.0, 12.0, 22.0]}
    lines = render(runs, "before").splitlines()
    assert lines[0] == "| mode | load | before tok/s (runs) | after tok/s (runs) | after / before |"
    # off c=1: medians 11 (before) and 22 (after); on c=4: 22 and 22. Loads sort before modes.
    assert lines[2] == "| off | 1 | 11.0 (10.0 / 20.0 / 11.0) | 22.0 (30.0 / 12.0 / 22.0) | 2.00 |"
    assert lines[3] == "| on | 4 | 22.0 (20.0 / 40.0 / 22.0) | 22.0 (30.0 / 12.0 / 22.0) | 1.00 |"
