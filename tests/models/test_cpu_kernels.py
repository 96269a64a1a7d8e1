"""models.cpu_kernels: building the CPU kernel library, and serving without it."""

from __future__ import annotations

import logging
import os
import time

from models import cpu_kernels, layer_ops, paged_attention


def test_failed_build_falls_back_to_torch(monkeypatch, tmp_path, caplog):
    from torch.utils import cpp_extension

    def no_compiler(**_):
        raise RuntimeError("Error building extension 'specd_cpu_kernels': c++: command not found")

    monkeypatch.setattr(paged_attention, "_enabled", paged_attention.enabled())  # restored after
    monkeypatch.setattr(layer_ops, "_fused", layer_ops.enabled())
    monkeypatch.setattr(cpu_kernels, "_available", None)
    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with caplog.at_level(logging.WARNING, logger="specd.models"):
        assert cpu_kernels.load(tmp_path) is False
    assert "CPU kernels not built (Error building extension" in caplog.text
    assert not cpu_kernels.available()
    paged_attention.use(True)
    layer_ops.use(True)
    # asked for, but nothing to run: decode rows gather, layers run torch's operations
    assert paged_attention.enabled() is False and layer_ops.enabled() is False


def test_a_missing_source_falls_back(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "_available", None)
    monkeypatch.setattr(cpu_kernels, "SOURCES", [tmp_path / "gone.cpp"])
    assert cpu_kernels.load(tmp_path) is False


def test_a_killed_build_s_lock_does_not_hang_the_next_start(monkeypatch, tmp_path):
    """torch's builder waits forever on a lock left by a build that was killed; an old one goes."""
    from torch.utils import cpp_extension

    build_dir = tmp_path / "kernels" / f"cpu-{cpu_kernels._build_tag()}"
    build_dir.mkdir(parents=True)
    lock = build_dir / "lock"
    lock.touch()
    old = time.time() - cpu_kernels.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    seen: list[bool] = []
    monkeypatch.setattr(cpu_kernels, "_available", None)
    monkeypatch.setattr(cpp_extension, "load", lambda **_: seen.append(lock.exists()) or None)
    cpu_kernels.load(tmp_path)
    assert seen == [False]
    fresh = build_dir / "lock"
    fresh.touch()  # a build running right now keeps its lock
    monkeypatch.setattr(cpu_kernels, "_available", None)
    cpu_kernels.load(tmp_path)
    assert seen == [False, True]


def test_the_build_tag_follows_every_source_and_header(monkeypatch, tmp_path):
    sources = []
    for name in ("a.cpp", "b.cpp", "c.h"):
        (tmp_path / name).write_text(f"// {name}\n")
        sources.append(tmp_path / name)
    monkeypatch.setattr(cpu_kernels, "SOURCES", sources[:2])
    monkeypatch.setattr(cpu_kernels, "HEADERS", sources[2:])
    tags = {cpu_kernels._build_tag()}
    for path in sources:
        path.write_text(path.read_text() + "// edited\n")
        tags.add(cpu_kernels._build_tag())
    assert len(tags) == 4
