"""Opening a GGUF file: gguf's reader, with each tensor's extent checked against the file's
size first, so that a truncated file is a `ModelLoadError` naming the tensor it cuts off
(read by the weights' loader, gguf.py, and the tokenizer's, gguf_tokenizer.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..base import ModelLoadError


def open_reader(path: Path):
    """A GGUFReader, or a ModelLoadError naming the tensor a truncated file cuts off."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader

    class Reader(GGUFReader):
        def _build_tensors(self, start_offs, fields):  # check bounds before gguf reshapes
            size = len(self.data)
            for f in fields:
                try:
                    _, name, _, dims, raw_type, offset = f.parts
                    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(int(raw_type[0]))]
                    end = start_offs + int(offset[0]) + int(np.prod(dims)) * type_size // block
                except Exception:  # an unexpected gguf version: let gguf itself decide
                    break
                if end > size:
                    raise ModelLoadError(
                        f"{path}: file is truncated: tensor {bytes(name).decode(errors='replace')}"
                        f" needs bytes up to {end:,} but the file has {size:,}"
                    )
            super()._build_tensors(start_offs, fields)

    try:
        return Reader(path)
    except ModelLoadError:
        raise
    except Exception as e:  # noqa: BLE001 -- gguf raises ValueError/IndexError/KeyError...
        msg = f"{path}: not a readable GGUF file ({type(e).__name__}: {e})"
        raise ModelLoadError(msg) from None
