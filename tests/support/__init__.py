"""What the test suites share (import as `tests.support.<module>`; pytest puts the repo root on
sys.path through `pythonpath` in pyproject.toml, `python -m` from the repo root does the same):

- `server`: one `specd serve` process (`SpecdServer`), its argument list (`serve_args`),
  `free_port`, `start_server` / `finish_server`.
- `metrics`: one /metrics scrape parsed by prometheus_client (`Metrics`), and `wait_idle`.
- `cycle`: the cycle model, whose output is known exactly, and its oracle `CycleText`.
- `tiny_models`: tiny random HF models and a locally trained tokenizer (no download).
- `probe_serve`: `specd serve` plus a test-only GET /_probe (`SpecdServer(..., probe=True)`).

This package imports nothing heavy (no torch), so `benchmarks.serve_bench` can use it.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
