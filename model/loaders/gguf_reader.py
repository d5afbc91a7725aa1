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

    from gguf import GGUFValueType

    class Reader(GGUFReader):
        def _get_field_parts(self, orig_offs, raw_type):
            # Arrays in one piece: gguf's reader makes a numpy view per element, 12 s for
            # Gemma's 262,144 tokens, scores and types; here one view per scalar array and
            # a memoryview per string (what `ReaderField.contents` reads back the same).
            if GGUFValueType(raw_type) != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            offs, n = orig_offs + 12, int(alen[0])
            sub = GGUFValueType(int(itype[0]))
            scalar = self.gguf_scalar_to_np.get(sub)
            if scalar is not None:
                values = self._get(offs, scalar, n)
                if len(values) != n:
                    raise ValueError(f"array of {n} runs past the end of the file")
                return 12 + int(values.nbytes), [itype, alen, values], [2], \
                    [GGUFValueType.ARRAY, sub]
            if sub != GGUFValueType.STRING:
                return super()._get_field_parts(orig_offs, raw_type)
            mv = memoryview(self.data).cast("B")
            parts: list = [itype, alen]
            for _ in range(n):
                size = int.from_bytes(mv[offs:offs + 8], "little")
                if offs + 8 + size > len(mv):
                    raise ValueError("a string runs past the end of the file")
                parts += [mv[offs:offs + 8], mv[offs + 8:offs + 8 + size]]
                offs += 8 + size
            return offs - orig_offs, parts, list(range(3, len(parts), 2)), \
                [GGUFValueType.ARRAY, GGUFValueType.STRING]

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
