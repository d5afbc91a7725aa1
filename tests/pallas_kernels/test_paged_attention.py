"""Pallas paged-attention kernels against the dense reference.

Every case runs in Pallas interpret mode (CPU, CI) and, when the default backend is a GPU,
again compiled (the `mode` fixture reruns the whole suite). Shapes are tiny: interpret
mode is slow on a 2-core CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import block_sizes as bs
from pallas_kernels.pallas_gpu import paged_attention_pallas
from pallas_kernels.reference import paged_attention_dense as _dense

ON_GPU = jax.default_backend() == "gpu"

# jax >= 0.11 warns at each Triton lowering that the backend is deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:.*Triton.*")


@pytest.fixture(params=["interpret", pytest.param("compiled", marks=pytest.mark.skipif(
    not ON_GPU, reason="compiled kernels need a GPU"))])
def interpret(request) -> bool:
    return request.param == "interpret"


@dataclasses.dataclass(frozen=True)
class Case:
    context_lens: tuple[int, ...]
    query_lens: tuple[int, ...]
    queries: int = 0  # query bucket; 0 = max(query_lens)
    page_size: int = 8
    kv_heads: int = 1
    group: int = 1  # query heads per KV head
    head_dim: int = 64
    dtype: str = "float32"
    scramble: bool = True  # page tables in random pool order
    splits: int | None = None  # decode path: None = the table's choice
    block_k: int | None = None  # override the table's key block


CASES = {
    # decode (one query per sequence), ragged context lengths, page boundaries
    "decode-len1-and-page-edges": Case((1, 8, 9, 16, 17), (1, 1, 1, 1, 1), kv_heads=2),
    "decode-gqa3-d128": Case((3, 24, 25), (1, 1, 1), group=3, head_dim=128),
    "decode-gqa8-bf16": Case((7, 16, 40), (1, 1, 1), group=8, dtype="bfloat16"),
    "decode-split3": Case((1, 33, 70), (1, 1, 1), kv_heads=2, group=3, splits=3),
    "decode-split4-bf16": Case((64, 5, 47), (1, 1, 1), group=8, page_size=16,
                               dtype="bfloat16", splits=4, block_k=16),
    "decode-split-more-than-blocks": Case((2, 17), (1, 1), group=3, splits=5, block_k=16),
    "decode-padding-seq": Case((0, 12, 0), (0, 1, 0), group=3, splits=2),
    "decode-padding-seq-nosplit": Case((0, 12), (0, 1), group=3, splits=1),
    # prefill from scratch (query_len == context_len)
    "prefill-p8": Case((5, 16, 17), (5, 16, 17), kv_heads=2),
    "prefill-p16-gqa3": Case((13, 32), (13, 32), page_size=16, group=3),
    "prefill-gqa8-d128-bf16": Case((9, 24), (9, 24), group=8, head_dim=128, dtype="bfloat16"),
    "prefill-len1": Case((1, 1), (1, 1), queries=4, group=3),
    # chunks after a cached prefix, starting mid-page or on a page boundary
    "chunk-mid-page": Case((21, 30), (7, 11), page_size=8, group=3),
    "chunk-on-page-boundary": Case((24, 32), (8, 16), page_size=8, kv_heads=2),
    "chunk-mid-page-p16-bf16": Case((37, 50), (12, 3), page_size=16, group=8,
                                    dtype="bfloat16"),
    "chunk-ends-on-boundary-d128": Case((32, 48), (13, 16), page_size=16, head_dim=128),
    # mixed ragged batches with padding rows and padding sequences
    "ragged-mixed": Case((0, 30, 12, 16, 9), (0, 1, 7, 16, 2), queries=16, kv_heads=2,
                         group=3),
    "ragged-mixed-bf16-p16": Case((40, 3, 17), (5, 3, 1), queries=8, page_size=16, group=3,
                                  dtype="bfloat16"),
    "ragged-unscrambled": Case((10, 19), (4, 19), scramble=False, group=3),
    # block and page sizes that do not line up
    "page-size-5": Case((11, 23), (4, 23), page_size=5, group=3),
    "page-size-32-block-16": Case((45, 70), (1, 9), page_size=32, block_k=16),
    "page-size-16-block-64-gqa8": Case((100, 7), (20, 7), page_size=16, group=8,
                                       block_k=64),
}


def _make_inputs(case: Case, seed: int = 0):
    rng = np.random.default_rng(seed)
    seqs = len(case.context_lens)
    queries = case.queries or max(case.query_lens)
    heads = case.kv_heads * case.group
    ps = case.page_size
    pages_per_seq = max(1, -(-max(case.context_lens) // ps)) + 1  # one spare column
    used = [-(-c // ps) for c in case.context_lens]
    num_pages = 1 + sum(used) + 3  # null page, the pages in use, a few strangers
    ids = np.arange(1, num_pages)
    if case.scramble:
        ids = rng.permutation(ids)
    tables = np.zeros((seqs, pages_per_seq), np.int32)
    at = 0
    for s, n in enumerate(used):
        tables[s, :n] = ids[at:at + n]
        at += n
    dtype = jnp.dtype(case.dtype)
    # Random everywhere, padding included: the null page and padding query rows hold
    # garbage that must not leak into the result.
    q = rng.standard_normal((seqs, queries, heads, case.head_dim))
    k = rng.standard_normal((num_pages, ps, case.kv_heads, case.head_dim))
    v = rng.standard_normal((num_pages, ps, case.kv_heads, case.head_dim))
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
            jnp.asarray(tables), jnp.asarray(case.context_lens, jnp.int32),
            jnp.asarray(case.query_lens, jnp.int32))


def _sizes(case: Case, queries: int):
    sizes = bs.block_sizes(case.head_dim, case.page_size, case.dtype, queries)
    if case.block_k is not None:
        sizes = dataclasses.replace(sizes, block_k=case.block_k)
    return sizes


def paged_attention_dense(*args):
    """The reference in full float32: XLA:GPU runs float32 dots in TF32 by default (errors
    of ~1e-3, seen on the H200), while the kernels ask for IEEE float32."""
    with jax.default_matmul_precision("highest"):
        return _dense(*args)


TOLERANCE = {"float32": dict(atol=2e-5, rtol=2e-5), "bfloat16": dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_reference(name, interpret):
    case = CASES[name]
    args = _make_inputs(case)
    queries = args[0].shape[1]
    out = paged_attention_pallas(*args, interpret=interpret, sizes=_sizes(case, queries),
                                 splits=case.splits)
    ref = paged_attention_dense(*args)
    assert out.shape == args[0].shape and out.dtype == args[0].dtype
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, **TOLERANCE[case.dtype])
    # Padding rows (past query_lens) are exactly zero.
    pad = np.arange(queries)[None, :] >= np.asarray(case.query_lens)[:, None]
    assert not out[pad].any()


WINDOWED = {  # (case, window): decode with and without splits, prompts, chunks
    "decode-w5": ("decode-len1-and-page-edges", 5),
    "decode-split4-w16-bf16": ("decode-split4-bf16", 16),
    "chunk-mid-page-w9": ("chunk-mid-page", 9),
    "ragged-mixed-w4": ("ragged-mixed", 4),
}


@pytest.mark.parametrize("name", list(WINDOWED))
def test_a_sliding_window_matches_reference(name, interpret):
    """`window`: each query over the keys of its window only (the key blocks before it
    skipped), as the dense reference's `window` (the sliding layers' kernel on a GPU)."""
    case, window = CASES[WINDOWED[name][0]], WINDOWED[name][1]
    args = _make_inputs(case, seed=1)
    queries = args[0].shape[1]
    out = paged_attention_pallas(*args, interpret=interpret, sizes=_sizes(case, queries),
                                 splits=case.splits, window=window)
    with jax.default_matmul_precision("highest"):
        ref = _dense(*args, window=window)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    np.testing.assert_allclose(out, ref, **TOLERANCE[case.dtype])
    assert not np.allclose(ref, np.asarray(paged_attention_dense(*args), np.float32))


def test_scale(interpret):
    """An explicit scale reaches the scores: scaling q by c is the same as scale c/sqrt(d)."""
    case = CASES["chunk-mid-page"]
    q, *rest = _make_inputs(case, seed=1)
    out = paged_attention_pallas(q, *rest, scale=0.3, interpret=interpret)
    ref = paged_attention_dense(q * (0.3 * case.head_dim ** 0.5), *rest)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=2e-5)


def _bad(**changes):
    case = Case((9, 4), (3, 1), group=2)
    q, k, v, pt, cl, ql = _make_inputs(case)
    args = dict(q=q, k_pages=k, v_pages=v, page_tables=pt, context_lens=cl, query_lens=ql)
    args.update({key: f(args) for key, f in changes.items()})
    return args


INVALID = {
    "q-rank": (dict(q=lambda a: a["q"][0]), "q must be"),
    "kv-shapes": (dict(v_pages=lambda a: a["v_pages"][:-1]), "v_pages.shape"),
    "kv-dtype": (dict(k_pages=lambda a: a["k_pages"].astype(jnp.bfloat16)), "share a dtype"),
    "int-q": (dict(q=lambda a: a["q"].astype(jnp.int32)), "q.dtype"),
    "head-dim-mismatch": (dict(q=lambda a: a["q"][..., :32]), "head_dim mismatch"),
    "head-dim-pow2": (dict(q=lambda a: a["q"][..., :48], k_pages=lambda a: a["k_pages"][..., :48],
                           v_pages=lambda a: a["v_pages"][..., :48]), "power of two"),
    "head-ratio": (dict(q=lambda a: a["q"][:, :, :1], k_pages=lambda a: jnp.tile(a["k_pages"], (1, 1, 2, 1)),
                        v_pages=lambda a: jnp.tile(a["v_pages"], (1, 1, 2, 1))), "multiple of"),
    "page-size": (dict(k_pages=lambda a: a["k_pages"][:, :0], v_pages=lambda a: a["v_pages"][:, :0]),
                  "at least one token"),
    "table-rows": (dict(page_tables=lambda a: a["page_tables"][:1]), "page_tables must be"),
    "table-dtype": (dict(page_tables=lambda a: a["page_tables"].astype(jnp.int16)), "int32"),
    "lens-shape": (dict(context_lens=lambda a: a["context_lens"][:1]), "context_lens and"),
    "lens-dtype": (dict(query_lens=lambda a: a["query_lens"].astype(jnp.float32)), "int32"),
}


@pytest.mark.parametrize("name", list(INVALID))
def test_rejects_bad_inputs(name):
    changes, message = INVALID[name]
    args = _bad(**changes)
    with pytest.raises(ValueError, match=message):
        paged_attention_pallas(**args, interpret=True)


def test_rejects_bad_block_k():
    args = _bad()
    sizes = dataclasses.replace(bs.block_sizes(64, 8, "float32", 3), block_k=24)
    with pytest.raises(ValueError, match="block_k"):
        paged_attention_pallas(**args, interpret=True, sizes=sizes)


def test_block_size_table():
    assert bs.query_class(1) == "decode" and bs.query_class(64) == "chunk"
    assert bs.query_class(65) == "prefill"
    row = bs.block_sizes(128, 16, jnp.bfloat16, 1)
    assert row == bs.TABLE[(128, 16, "bfloat16", "decode")]
    # Any page size falls back to the page-size-free row; unknown shapes to the default.
    assert bs.block_sizes(128, 5, "bfloat16", 1) == bs.TABLE[(128, None, "bfloat16", "decode")]
    assert bs.block_sizes(32, 16, "float16", 300).block_k >= 16
    for sizes in bs.TABLE.values():
        assert sizes.block_k >= 16 and not sizes.block_k & (sizes.block_k - 1)
        assert sizes.block_rows >= 1 and not sizes.block_rows & (sizes.block_rows - 1)


def test_decode_splits():
    sizes = bs.block_sizes(128, 16, "bfloat16", 1)
    # Batch fills the chip on its own: no split.
    assert bs.decode_splits(256, 8, 32768, sizes) == 1
    # Batch 1 at long context: split up to the target, each split >= min_keys_per_split.
    n = bs.decode_splits(1, 8, 32768, sizes)
    assert n > 8 and 32768 // n >= sizes.min_keys_per_split
    # Short context caps the split count.
    assert bs.decode_splits(1, 8, 512, sizes) == 512 // sizes.min_keys_per_split


# (seqs, queries, splits, dtype, page_size, num_pages, pages_per_seq, kv_heads, group)
TRITON_SHAPES = {
    "decode-split-8b": (4, 1, 4, jnp.bfloat16, 16, 1024, 64, 8, 4),
    "decode-nosplit-8b": (4, 1, 1, jnp.bfloat16, 16, 1024, 64, 8, 4),
    "chunk-bf16-8b": (4, 48, None, jnp.bfloat16, 16, 1024, 64, 8, 4),
    "prefill-f32": (2, 128, None, jnp.float32, 16, 1024, 64, 8, 4),
    "odd-shapes": (3, 5, None, jnp.bfloat16, 5, 37, 7, 3, 3),
    "odd-shapes-decode-split": (3, 1, 3, jnp.float32, 12, 37, 7, 2, 3),
    # sliding windows (Gemma 3's 512 keys): the window's mask and first key block
    "decode-split-window": (4, 1, 4, jnp.bfloat16, 16, 1024, 64, 8, 4, 512),
    "chunk-window": (4, 48, None, jnp.bfloat16, 16, 1024, 64, 8, 4, 512),
}


@pytest.mark.parametrize("name", list(TRITON_SHAPES))
def test_lowers_to_triton_ir(name):
    """Lower the kernels for CUDA on this CPU: every primitive has a Triton lowering and
    every loaded block has a power-of-two size. (jaxlib <= 0.10.2 emits the Triton IR
    without compiling it; later versions compile at lowering, which needs a GPU.)"""
    try:
        from jax._src.lib import version as jaxlib_version
    except ImportError:
        jaxlib_version = (999,)
    if tuple(jaxlib_version) > (0, 10, 2) and not ON_GPU:
        pytest.skip("this jaxlib compiles Triton at lowering time: needs a GPU")
    seqs, queries, splits, dtype, ps, pages, pps, kvh, group, *window = TRITON_SHAPES[name]
    d = 128
    spec = jax.ShapeDtypeStruct
    args = (spec((seqs, queries, kvh * group, d), dtype), spec((pages, ps, kvh, d), dtype),
            spec((pages, ps, kvh, d), dtype), spec((seqs, pps), jnp.int32),
            spec((seqs,), jnp.int32), spec((seqs,), jnp.int32))
    f = jax.jit(functools.partial(paged_attention_pallas, splits=splits,
                                  window=window[0] if window else 0))
    traced = f.trace(*args)
    lowered = traced.lower() if ON_GPU else traced.lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "triton" in text
