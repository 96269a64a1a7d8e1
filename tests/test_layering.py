"""The packages import one way: parsed from the sources, not taken on trust from the docs.

server -> scheduler -> worker -> speculation -> models, with scheduler/types.py (wire
types) and scheduler/kv_blocks.py (block arithmetic) below them all; models/ never imports
speculation/, worker/ or the server.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("server", "scheduler", "worker", "speculation", "models", "training")
# What each package may import from the others (modules named in full where only some may be).
ALLOWED = {
    "models": {"scheduler.types", "scheduler.kv_blocks"},
    "speculation": {"models", "scheduler.types"},
    "worker": {"models", "speculation", "scheduler.types", "scheduler.kv_blocks"},
    "scheduler": {"speculation"},  # the policy plans steps; a runner reaches the engine only as `Executor`
}


def imports(package: str) -> dict[str, set[str]]:
    """Module path -> the first-party modules it imports (at any level, TYPE_CHECKING included)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        found[str(path.relative_to(ROOT))] = {n for n in names if n.split(".")[0] in PACKAGES}
    return found


def allowed(package: str, name: str) -> bool:
    if name.split(".")[0] == package:
        return True
    return any(name == rule or name.startswith(rule + ".") for rule in ALLOWED.get(package, ()))


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_each_package_imports_only_the_layers_below_it(package):
    wrong = {module: sorted(n for n in names if not allowed(package, n)) for module, names in imports(package).items()}
    assert {m: n for m, n in wrong.items() if n} == {}


def test_models_and_speculation_meet_one_way():
    assert not any(n.startswith("speculation") for names in imports("models").values() for n in names)
    assert any(n.startswith("models") for names in imports("speculation").values() for n in names)


def test_kinds_are_named_only_by_the_registry_and_their_own_modules():
    """No `method == "eagle"`-style branch and no `cast` between proposer types outside them."""
    kinds = ("ngram", "suffix", "draft_model", "eagle", "prediction")
    own = {f"speculation/{name}.py" for name in (*kinds, "registry", "suffix_tree")}
    offenders = []
    for package in ("server", "scheduler", "worker", "speculation", "models"):
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in own:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Compare):
                    constants = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant)]
                    offenders += [f"{rel}:{node.lineno}" for c in constants if c in kinds]
                elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "cast":
                    offenders.append(f"{rel}:{node.lineno} cast")
    assert offenders == []
