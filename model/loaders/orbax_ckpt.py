"""Orbax checkpoints: the fast path for loading a model again.

GGUF loading parses tens of thousands of metadata strings and dequantizes every tensor;
an orbax checkpoint stores the finished parameter tree, so `sluice convert SRC DST` pays
that once. The directory is self-contained:

    DST/params/               the parameter tree (orbax PyTreeCheckpointer, OCDBT)
    DST/tokenizer.json        tokenizers' own serialization (pre-tokenizer, specials, ...)
    DST/tokenizer_config.json chat_template, bos_token, eos_token (Hugging Face names)
    DST/generation_config.json extra end-of-turn ids
    DST/sluice_model.json     ModelConfig + format version; written last, so its presence
                              means the checkpoint is complete

Arrays keep the dtype they were saved with unless `dtype` asks otherwise, so a bf16 8B
model stays 16 GB on the way back in.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from ..base import LoadedModel, ModelLoadError, check_shape, flatten, param_shapes
from ..base import resolve_dtype
from ..config import ModelConfig
from ..progress import progress as _progress
from ..tokenizer import Tokenizer

CONFIG_FILE = "sluice_model.json"
FORMAT = 1


def save_orbax(loaded: LoadedModel, dst: str | Path, progress: bool = True) -> Path:
    """Write `loaded` to the directory `dst` (which must not exist yet)."""
    import orbax.checkpoint as ocp

    dst = Path(dst).expanduser().resolve()
    if dst.exists():
        raise FileExistsError(f"{dst} already exists")
    dst.mkdir(parents=True)
    try:
        with _progress(progress) as p:
            task = p.add_task(f"save {dst.name}", total=None)
            # Uncompressed: zstd saved only a third of the bytes of float weights and
            # made both saving and restoring slower.
            handler = ocp.PyTreeCheckpointHandler(use_compression=False)
            with ocp.Checkpointer(handler) as ckpt:
                ckpt.save(dst / "params", loaded.params)
            if loaded.tokenizer is not None:
                _save_tokenizer(loaded.tokenizer, dst)
            meta = {"format": FORMAT, "config": loaded.config.to_dict(), "source": loaded.source,
                    "tokenizer": loaded.tokenizer is not None}  # fmt: skip
            tmp = dst / (CONFIG_FILE + ".tmp")
            tmp.write_text(json.dumps(meta, indent=1))
            os.replace(tmp, dst / CONFIG_FILE)
            p.update(task, total=1, completed=1)
    except BaseException:
        shutil.rmtree(dst, ignore_errors=True)
        raise
    return dst


def load_orbax(path: str | Path, progress: bool = True, *, dtype=None) -> LoadedModel:
    import orbax.checkpoint as ocp


    path = Path(path).expanduser().resolve()
    meta_file = path / CONFIG_FILE
    try:
        meta = json.loads(meta_file.read_text())
        config = ModelConfig.from_dict(meta["config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{meta_file}: not a sluice checkpoint description ({e})") from None
    if meta.get("format") != FORMAT:
        fmt = meta.get("format")
        raise ModelLoadError(f"{meta_file}: format {fmt}, this sluice reads {FORMAT}")
    shapes = param_shapes(config)
    with _progress(progress) as p:
        task = p.add_task(f"restore {path.name}", total=None)
        try:
            with ocp.PyTreeCheckpointer() as ckpt:
                stored = ckpt.metadata(path / "params").item_metadata
                if stored is None:
                    msg = f"{path}/params: checkpoint metadata missing or unreadable"
                    raise ModelLoadError(msg)
                stored = stored.tree
                _check_tree(stored, shapes, path)
                restore_args = _tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), stored)
                params = ckpt.restore(path / "params", restore_args=restore_args)
        except ModelLoadError:
            raise
        except Exception as e:  # noqa: BLE001 -- tensorstore/orbax errors on damaged files
            msg = f"{path}/params: cannot restore ({type(e).__name__}: {e})"
            raise ModelLoadError(msg) from None
        if dtype is not None:
            dt = resolve_dtype(dtype)
            params = _tree_map(lambda a: np.asarray(a, dt), params)
        p.update(task, total=1, completed=1)
    tokenizer = Tokenizer.from_hf_dir(path) if meta.get("tokenizer") else None
    return LoadedModel(config, params, tokenizer, str(path))  # meta["source"]: the original


def _save_tokenizer(tok, dst: Path) -> None:
    tok.hf.save(str(dst / "tokenizer.json"))
    cfg = {"chat_template": tok.chat_template, "bos_token": tok.bos_token,
           "eos_token": tok.eos_token}  # fmt: skip
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    gen = {"eos_token_id": sorted(tok.eos_token_ids)}
    (dst / "generation_config.json").write_text(json.dumps(gen))


def _check_tree(stored: dict, shapes: dict, path: Path) -> None:
    """Missing or misshapen tensors, named, before orbax reads a byte."""
    have = dict(flatten(stored)) if isinstance(stored, dict) and "layers" in stored else {}
    for name, shape in shapes.items():
        if name not in have:
            raise ModelLoadError(f"{path}: tensor {name} is missing from the checkpoint")
        check_shape(have[name], shape, path, name)


def _tree_map(fn, tree):
    if isinstance(tree, dict):
        return {k: _tree_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_tree_map(fn, v) for v in tree]
    return fn(tree)
