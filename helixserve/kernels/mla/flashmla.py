"""DeepSeek FlashMLA's sm90 dense MLA decode as an optional backend of ``mla_paged_attention``.

The kernels come from ``libflashmla_dense.so``, built by ``make flashmla`` (``deploy/flashmla/build.sh``:
FlashMLA 9241ae3, MIT, fetched at build time, plus our C API ``deploy/flashmla/capi.cu``) and loaded
once, lazily, through ctypes from ``HELIXSERVE_FLASHMLA_LIB`` or ``~/.cache/helixserve/flashmla/``.
``HELIXSERVE_MLA_BACKEND`` (``auto`` | ``triton`` | ``flashmla``, :func:`helixserve.config.mla_backend`)
decides whether decode calls may use it.

:func:`paged_decode` serves decode calls: one query per sequence that sees every key of its sequence
(``cu_seqlens_q == arange(B + 1)``, ``q_positions == kv_lens - 1``)::

    q [B, H, 576] bf16, kv_cache [NB, 64, 576] bf16, block_tables [B, MB] int, kv_lens [B] int
    -> o [B, H, 512] bf16, lse [B, H] float32

in :func:`~helixserve.kernels.mla.paged.mla_paged_attention`'s convention (natural log; a row with no
key gives o = 0, lse = -inf, where FlashMLA writes lse = +inf). FlashMLA has no "block held elsewhere"
entry, so the ``-1`` entries (helix ownership, CUDA-graph padding rows) are first compacted out on the
device (:func:`compact_tables`). Everything runs on the current stream with workspaces from torch's
allocator and no host sync, so a call can be captured in a CUDA graph; the tile-scheduler metadata
depends on the kv lengths' values and is recomputed on every call (one small kernel).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from pathlib import Path

import torch

from helixserve.config import flashmla_library, mla_backend

logger = logging.getLogger(__name__)

CAPI_VERSION = 1  # flashmla_capi_version() of the capi.cu this module speaks to
HEAD_DIM_K, HEAD_DIM_V, PAGE_SIZE = 576, 512, 64
_MAX_SM_PARTS = 160  # FlashMLA's combine kernel handles at most this many splits


class FlashMLAUnavailable(RuntimeError):
    """FlashMLA cannot run here: the library is missing, does not load, is stale, or the device is not sm90."""


class FlashMLAShapeError(ValueError):
    """Inputs FlashMLA's compiled decode kernel cannot take (the message names the offending value)."""


class FlashMLAError(RuntimeError):
    """The FlashMLA library refused a call (its own message)."""


_lock = threading.Lock()
_state: tuple[ctypes.CDLL | None, str | None] | None = None  # (library, why not), set by the first load
_thread = threading.local()  # .device: the device last selected in the library's (static) CUDA runtime
_logged: set[str] = set()


def library_path() -> Path:
    return flashmla_library()


@functools.cache
def setting() -> str:
    """``HELIXSERVE_MLA_BACKEND``, read once (``setting.cache_clear()`` reads it again)."""
    return mla_backend()


def reset() -> None:
    """Forget the loaded library and the setting (tests; a changed ``HELIXSERVE_FLASHMLA_LIB``)."""
    global _state
    with _lock:
        _state = None
    setting.cache_clear()
    _workspace_sizes.cache_clear()
    _thread.device = None
    _logged.clear()


def load() -> ctypes.CDLL:
    """The library, loaded on the first call; raises :class:`FlashMLAUnavailable` (why) when it cannot be."""
    global _state
    state = _state  # (set once; a decode call per layer reads it without the lock)
    if state is None:
        with _lock:
            if _state is None:
                _state = _open(library_path())
            state = _state
    lib, reason = state
    if lib is None:
        raise FlashMLAUnavailable(reason)
    return lib


def _open(path: Path) -> tuple[ctypes.CDLL | None, str | None]:
    hint = "build it with `make flashmla` or point HELIXSERVE_FLASHMLA_LIB at it"
    if not path.is_file():
        return None, f"no FlashMLA library at {path} ({hint})"
    try:
        lib = ctypes.CDLL(str(path))
        _declare(lib)
    except (OSError, AttributeError) as exc:
        return None, f"cannot load the FlashMLA library {path}: {exc} ({hint})"
    version = lib.flashmla_capi_version()
    if version != CAPI_VERSION:
        return None, f"{path} speaks C API version {version}, this helixserve needs {CAPI_VERSION} ({hint})"
    return lib, None


def _declare(lib: ctypes.CDLL) -> None:
    vp, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    signatures = {
        "flashmla_capi_version": (i32, []),
        "flashmla_last_error": (ctypes.c_char_p, []),
        "flashmla_set_device": (i32, [i32]),
        "flashmla_workspace_sizes": (i32, [i32, i32, i32, i32, ctypes.POINTER(i64), ctypes.POINTER(i32)]),
        "flashmla_get_metadata": (i32, [vp, i32, i32, i32, vp, vp, vp]),
        "flashmla_dense_decode": (i32, [
            vp, i64, i64, i64,              # q, its strides over b, s, h
            vp, i64, i64, i32,              # kcache, its block and row strides, num_blocks
            vp, i64, vp,                    # block_table, its row stride, seqlens_k
            vp, vp,                         # out, lse
            vp, vp, i32, vp, vp,            # tile metadata, num_splits, num_sm_parts, lse_accum, o_accum
            i32, i32, i32, i32, i32, i32,   # b, s_q, h_q, head_dim_k, head_dim_v, page_block_size
            f32, i32, vp,                   # softmax_scale, is_causal, stream
        ]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes


def _check(lib: ctypes.CDLL, rc: int) -> None:
    if rc != 0:
        raise FlashMLAError(lib.flashmla_last_error().decode(errors="replace"))


def unavailable_reason(device: torch.device) -> str | None:
    """Why FlashMLA cannot run on ``device`` (``None``: it can)."""
    try:
        load()
    except FlashMLAUnavailable as exc:
        return str(exc)
    if device.type != "cuda":
        return f"{device} is not a CUDA device"
    return _arch_reason(_device_index(device))


def available(device: torch.device) -> bool:
    """The library loads and ``device`` is a CUDA sm90 GPU."""
    return unavailable_reason(device) is None


def require_if_forced(device: torch.device) -> None:
    """With ``HELIXSERVE_MLA_BACKEND=flashmla``: raise :class:`FlashMLAUnavailable` unless FlashMLA runs on ``device``."""
    if setting() == "flashmla":
        reason = unavailable_reason(device)
        if reason is not None:
            raise FlashMLAUnavailable(f"HELIXSERVE_MLA_BACKEND=flashmla but {reason}")


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _arch_reason(index: int) -> str | None:
    major, minor = torch.cuda.get_device_capability(index)
    if (major, minor) != (9, 0):
        return f"cuda:{index} is sm_{major}{minor}; FlashMLA's dense decode is built for sm_90a only"
    return None


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sm_parts(num_heads: int, num_sms: int) -> int:
    """FlashMLA's split count per request block for one query token: ``max(num_sms // ceil(H / 64), 1)``."""
    return max(num_sms // -(-num_heads // 64), 1)


def unsupported_reason(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor, v_dim: int,
) -> str | None:
    """Why FlashMLA's kernel cannot take these decode inputs (``None``: it can); reads no tensor values."""
    if q.dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16:
        return f"q / kv_cache are {q.dtype} / {kv_cache.dtype}, FlashMLA is built for bfloat16"
    if q.dim() != 3 or q.shape[2] != HEAD_DIM_K or v_dim != HEAD_DIM_V:
        return f"head dims {tuple(q.shape[2:])} / v_dim {v_dim}, FlashMLA needs {HEAD_DIM_K} / {HEAD_DIM_V}"
    if kv_cache.dim() != 3 or tuple(kv_cache.shape[1:]) != (PAGE_SIZE, HEAD_DIM_K):
        return f"kv_cache pages {tuple(kv_cache.shape[1:])}, FlashMLA needs ({PAGE_SIZE}, {HEAD_DIM_K})"
    B, H = q.shape[0], q.shape[1]
    if B == 0 or H == 0 or kv_cache.shape[0] == 0 or block_tables.dim() != 2 or block_tables.shape[1] == 0:
        return f"empty inputs (q {tuple(q.shape)}, {kv_cache.shape[0]} blocks, tables {tuple(block_tables.shape)})"
    if len({q.device, kv_cache.device, block_tables.device, kv_lens.device}) != 1:
        return "q, kv_cache, block_tables and kv_lens are on different devices"
    # TMA: 16-byte aligned bases and strides, unit stride on the last dim
    for name, t in (("q", q), ("kv_cache", kv_cache)):
        if t.stride(2) != 1 or t.stride(1) % 8 or t.stride(0) % 8 or t.data_ptr() % 16:
            return f"{name} strides {t.stride()} / alignment: FlashMLA needs a unit last stride, 16-byte aligned rows"
    if q.is_cuda and num_sm_parts(H, _num_sms(_device_index(q.device))) > _MAX_SM_PARTS:
        return f"{_num_sms(_device_index(q.device))} SMs: more than FlashMLA's {_MAX_SM_PARTS} splits at H={H}"
    return None


def skip_reason(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor, v_dim: int,
) -> str | None:
    """Why this decode call does not take FlashMLA (``None``: it does), after the setting, the library,
    the device and the shapes; the first call of each outcome is logged."""
    if setting() == "triton":
        reason: str | None = "HELIXSERVE_MLA_BACKEND=triton"
    else:
        reason = unavailable_reason(q.device) or unsupported_reason(q, kv_cache, block_tables, kv_lens, v_dim)
    _log_once(reason)
    return reason


def _log_once(reason: str | None) -> None:
    """Log the backend a decode call took, once per outcome (the message is built only then)."""
    key = reason or ""
    if key not in _logged:
        _logged.add(key)
        logger.info("MLA decode backend: %s", f"FlashMLA ({library_path()})" if reason is None
                    else f"not FlashMLA ({reason})")


def compact_tables(block_tables: torch.Tensor, kv_lens: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables without ``-1`` entries: ``(tables int32 [B, MB], lens int32 [B])``, on the device.

    Row i's locally held blocks among its first ``ceil(kv_lens[i] / page_size)`` move to the front in
    their order; ``lens[i]`` is the number of keys they hold; the other entries are 0 (a valid block,
    never read as a key). One query's attention does not depend on the order of its keys, and only the
    last logical block can be partial: held, it stays last."""
    B, MB = block_tables.shape
    first_key = torch.arange(MB, device=block_tables.device, dtype=torch.int64) * page_size
    keys_in_block = (kv_lens.to(torch.int64)[:, None] - first_key).clamp_(0, page_size)  # [B, MB]
    held = (block_tables >= 0) & (keys_in_block > 0)
    # held block -> its rank among the held ones; every other entry -> the last column, which no held
    # block reaches unless all are held (then there is no other entry)
    dest = torch.where(held, held.cumsum(1) - 1, MB - 1)
    src = torch.where(held, block_tables, 0).to(torch.int32)
    tables = torch.zeros(B, MB, dtype=torch.int32, device=block_tables.device).scatter_(1, dest, src)
    lens = torch.where(held, keys_in_block, 0).sum(1).to(torch.int32)
    return tables, lens


@functools.lru_cache(maxsize=256)
def _workspace_sizes(batch: int, num_heads: int, num_sms: int) -> tuple[int, tuple[int, int, int, int]]:
    """``(num_sm_parts, bytes of: tile metadata, num_splits, lse_accum, o_accum)`` for one query per sequence."""
    lib = load()
    sizes = (ctypes.c_int64 * 4)()
    parts = ctypes.c_int(0)
    _check(lib, lib.flashmla_workspace_sizes(batch, 1, num_heads, num_sms, sizes, ctypes.byref(parts)))
    return parts.value, (sizes[0], sizes[1], sizes[2], sizes[3])


def _select_device(lib: ctypes.CDLL, index: int) -> None:
    """The library has its own (static) CUDA runtime: point it at torch's device, once per thread and device."""
    if getattr(_thread, "device", None) != index:
        _check(lib, lib.flashmla_set_device(index))
        _thread.device = index


def paged_decode(
    q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor, kv_lens: torch.Tensor, scale: float,
    v_dim: int = HEAD_DIM_V,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashMLA dense decode, one query per sequence over all of its locally held keys (shapes in the
    module docstring) -> ``(o [B, H, 512] bf16, lse [B, H] float32)``; a row with no key: 0, -inf."""
    reason = unsupported_reason(q, kv_cache, block_tables, kv_lens, v_dim)
    if reason is not None:
        raise FlashMLAShapeError(reason)
    if not q.is_cuda:
        raise FlashMLAUnavailable(f"{q.device} is not a CUDA device")
    lib = load()
    index = _device_index(q.device)
    _select_device(lib, index)
    B, H, _ = q.shape
    if block_tables.shape[0] != B or kv_lens.shape != (B,):
        raise FlashMLAShapeError(f"block_tables {tuple(block_tables.shape)} / kv_lens {tuple(kv_lens.shape)} "
                                 f"do not match {B} sequences")
    parts, sizes = _workspace_sizes(B, H, _num_sms(index))
    device = q.device
    tables, lens = compact_tables(block_tables, kv_lens, PAGE_SIZE)

    def buffer(nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(nbytes // dtype.itemsize, dtype=dtype, device=device)

    tile_md, num_splits = buffer(sizes[0], torch.int32), buffer(sizes[1], torch.int32)
    lse_accum, o_accum = buffer(sizes[2], torch.float32), buffer(sizes[3], torch.float32)
    out = torch.empty(B, H, HEAD_DIM_V, dtype=torch.bfloat16, device=device)  # FlashMLA's [B, 1, H, 512]
    lse = torch.empty(B, H, dtype=torch.float32, device=device)  # its raw [B, 1, H] buffer
    stream = torch.cuda.current_stream(device).cuda_stream
    _check(lib, lib.flashmla_get_metadata(lens.data_ptr(), B, 1, parts, tile_md.data_ptr(), num_splits.data_ptr(),
                                          stream))
    _check(lib, lib.flashmla_dense_decode(
        q.data_ptr(), q.stride(0), H * q.stride(1), q.stride(1),
        kv_cache.data_ptr(), kv_cache.stride(0), kv_cache.stride(1), kv_cache.shape[0],
        tables.data_ptr(), tables.stride(0), lens.data_ptr(),
        out.data_ptr(), lse.data_ptr(),
        tile_md.data_ptr(), num_splits.data_ptr(), parts, lse_accum.data_ptr(), o_accum.data_ptr(),
        B, 1, H, HEAD_DIM_K, HEAD_DIM_V, PAGE_SIZE, float(scale), 0, stream,
    ))
    return out, to_our_lse(lse)


def to_our_lse(lse: torch.Tensor) -> torch.Tensor:
    """FlashMLA's no-key rows (+inf) as ours (-inf), in place; every finite value is already a natural log."""
    return lse.masked_fill_(lse == float("inf"), float("-inf"))
