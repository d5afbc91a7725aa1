"""What a decode server and a prefill server say to each other (app/disagg.py).

The ask (`PrefillAsk`, msgpack): the model, the prompt's token ids, the first page the
asker lacks, its priority. The answer (`Wire`, msgpack, content type `CONTENT_TYPE`): the
model's fingerprint (model/kv_tiers.model_fingerprint: weights, formats, page layout),
the first page sent, the pages' shape and dtype, a CRC-32 of their bytes, and the bytes,
[n, K/V, layer, position, kv head, row] in C order; `decode` checks all of it against
the receiving replica before a page is used. Headers of the answer (and of a 429) say
how long the prefill and the copy out took and how loaded the prefill pool is.
"""

from __future__ import annotations

import zlib
from typing import Any

import msgspec
import numpy as np

PATH = "/internal/prefill"
CONTENT_TYPE = "application/vnd.sluice.kv+msgpack"
# The prefill server's answer: its compute and copy-out seconds, and its load.
PREFILL_S, COPY_S = "x-sluice-prefill-seconds", "x-sluice-copy-seconds"
WAITING, OLDEST = "x-sluice-waiting", "x-sluice-oldest-waiting-s"
FREE_PAGES = "x-sluice-kv-free-pages"


class PrefillAsk(msgspec.Struct, frozen=True):
    """A decode server's request: compute this prompt, send its full pages from
    `first_page` on."""

    model: str
    prompt_ids: list[int]
    first_page: int = 0
    priority: int = 0


ask_encoder = msgspec.msgpack.Encoder()
ask_decoder = msgspec.msgpack.Decoder(PrefillAsk)
WIRE_VERSION = 1


class Wire(msgspec.Struct, frozen=True):
    """One prefill's answer between processes."""

    version: int
    fingerprint: str  # the model and page layout (model/kv_tiers.model_fingerprint)
    first_page: int  # index of the first page sent in the prompt's pages
    shape: tuple[int, ...]  # [n, K/V, layer, position, kv head, row]
    dtype: str  # numpy dtype name
    crc32: int
    data: bytes


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Wire)


def encode(pages: np.ndarray, *, fingerprint: str, first_page: int) -> bytes:
    data = np.ascontiguousarray(pages).tobytes()
    return _encoder.encode(Wire(WIRE_VERSION, fingerprint, first_page, tuple(pages.shape),
                                pages.dtype.name, zlib.crc32(data), data))


class WireError(ValueError):
    """A message that is not what this replica can take (say why)."""


def decode(message: bytes, *, fingerprint: str, page_shape: tuple[int, ...],
           dtype: Any) -> tuple[int, np.ndarray]:
    """(first page index, pages [n, *page_shape]) of a message, checked
    against this replica's model and page layout, or `WireError`."""
    try:
        w = _decoder.decode(message)
    except msgspec.DecodeError as e:
        raise WireError(f"not a KV transfer message: {e}") from None
    if w.version != WIRE_VERSION:
        raise WireError(f"KV transfer version {w.version}, this server reads {WIRE_VERSION}")
    if w.fingerprint != fingerprint:
        raise WireError(f"the prefill server runs another model or KV layout "
                        f"({w.fingerprint} != {fingerprint})")
    dt = np.dtype(dtype)
    if tuple(w.shape[1:]) != tuple(page_shape) or w.dtype not in (dt.name, dt.str):
        raise WireError(f"pages of {w.shape[1:]} {w.dtype}, this pool's are "
                        f"{tuple(page_shape)} {dt.name}")
    if zlib.crc32(w.data) != w.crc32:
        raise WireError("KV transfer payload failed its checksum")
    n = w.shape[0] if w.shape else 0
    if len(w.data) != n * int(np.prod(page_shape)) * dt.itemsize or w.first_page < 0:
        raise WireError("KV transfer payload has the wrong length")
    pages = np.frombuffer(w.data, dt).reshape(n, *page_shape)
    return w.first_page, pages
