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

Sharded restore: each array is written in chunks (about 16 of them, over every axis), so
that a process of a multi-host tensor-parallel replica (model/multihost.py) reads only
its devices' slices of the tensors the replica splits (`Shards`: the columns of q/k/v
and gate/up, the rows of o and down, as model/tp.py splits them) and every other tensor
whole. The slices come back in arrays of the whole shape, zero elsewhere: the runner
places each device's slice on its device and never reads the rest. `LoadedModel.read_bytes`
says how many of the stored bytes were read.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np

from ..base import LoadedModel, ModelLoadError, check_shape, flatten, param_shapes
from ..base import resolve_dtype
from ..config import ModelConfig
from ..progress import progress as _progress
from ..tokenizer import Tokenizer

CONFIG_FILE = "sluice_model.json"
FORMAT = 1
CHUNKS = 16  # chunks an array is written in (fewer for small ones: >= MIN_CHUNK bytes each)
MIN_CHUNK = 4096

# The loader-layout tensors tensor parallelism splits (model/tp.py), by axis: the output
# columns of q/k/v and gate/up (and the q/k/v biases), the input rows of o and down.
SPLIT_AXIS = {"wq": -1, "wk": -1, "wv": -1, "w_gate": -1, "w_up": -1, "bq": -1, "bk": -1,
              "bv": -1, "wo": 0, "w_down": 0}


@dataclasses.dataclass(frozen=True)
class Shards:
    """What one process of a tensor-parallel replica reads of the split tensors: of
    `count` equal slices along each one's split axis, those at `positions` (its devices'
    places on the replica's mesh)."""

    count: int
    positions: tuple[int, ...]


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
            chunked = _tree_map(lambda a: ocp.SaveArgs(chunk_byte_size=max(
                np.asarray(a).nbytes // CHUNKS, MIN_CHUNK)), loaded.params)
            quiet = _NoChunkSizeWarning()  # (orbax warns under 1 MiB a chunk, each time)
            logging.getLogger("absl").addFilter(quiet)
            try:
                with ocp.Checkpointer(handler) as ckpt:
                    ckpt.save(dst / "params", args=ocp.args.PyTreeSave(loaded.params,
                                                                       save_args=chunked))
            finally:
                logging.getLogger("absl").removeFilter(quiet)
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


def load_orbax(path: str | Path, progress: bool = True, *, dtype=None,
               shards: Callable[[ModelConfig], Shards | None] | None = None) -> LoadedModel:
    """`shards(config)`: the slices of the split tensors this process reads (None: all;
    see the module doc)."""
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
    part = shards(config) if shards is not None else None
    read = None
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
                if part is None or set(part.positions) == set(range(part.count)):
                    restore_args = _tree_map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray),
                                             stored)
                    params = ckpt.restore(path / "params", restore_args=restore_args)
                else:
                    params, read = _restore_shards(path / "params", stored, part)
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
    # (meta["source"]: the original)
    return LoadedModel(config, params, tokenizer, str(path), read_bytes=read)


def _restore_shards(params_dir: Path, stored: dict, part: Shards) -> tuple[dict, tuple]:
    """The parameter tree read with tensorstore from the checkpoint's OCDBT store: the
    split tensors' slices at `part.positions` (zeros elsewhere), every other tensor whole;
    and (bytes read, bytes stored), counted in the chunks a read touches."""
    import tensorstore as ts

    base = f"file://{params_dir}/"
    done, total = 0, 0

    def read(name: str) -> np.ndarray:
        nonlocal done, total
        t = ts.open({"driver": "zarr", "kvstore": {"driver": "ocdbt", "base": base,
                                                   "path": name}}).result()
        shape, chunk = t.shape, t.schema.chunk_layout.read_chunk.shape
        itemsize = np.dtype(t.dtype.numpy_dtype).itemsize
        grid = [-(-n // c) for n, c in zip(shape, chunk)]
        total += int(np.prod(shape)) * itemsize
        axis = SPLIT_AXIS.get(name.rpartition(".")[2])
        if axis is None or shape[axis] % part.count:
            done += int(np.prod(shape)) * itemsize
            return np.asarray(t.read().result())
        axis %= len(shape)
        width = shape[axis] // part.count
        out = np.zeros(shape, t.dtype.numpy_dtype)
        touched = set()
        for pos in part.positions:
            at = [slice(None)] * len(shape)
            at[axis] = slice(pos * width, (pos + 1) * width)
            out[tuple(at)] = t[tuple(at)].read().result()
            touched.update(range(pos * width // chunk[axis], -(-(pos + 1) * width // chunk[axis])))
        chunk_bytes = int(np.prod(chunk)) * itemsize
        done += min(len(touched) * int(np.prod(grid)) // grid[axis] * chunk_bytes,
                    int(np.prod(shape)) * itemsize)
        return out

    params = {name: read(name) for name in stored if name != "layers"}
    params["layers"] = [{key: read(f"layers.{i}.{key}") for key in layer}
                        for i, layer in enumerate(stored["layers"])]
    return params, (done, total)


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


class _NoChunkSizeWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "target_byte_size too small" not in record.getMessage()


def _tree_map(fn, tree):
    if isinstance(tree, dict):
        return {k: _tree_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_tree_map(fn, v) for v in tree]
    return fn(tree)
