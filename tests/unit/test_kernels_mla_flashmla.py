"""FlashMLA backend of mla_paged_attention, on the CPU: the dispatch decisions (library missing,
backend forced, shapes FlashMLA cannot take), the device-side table compaction it relies on, and
the library loader. The kernel itself runs in tests/unit/test_gpu_flashmla.py."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from helixserve import config
from helixserve.kernels import mla_paged_attention
from helixserve.kernels.mla import flashmla
from helixserve.kernels.mla.naive import naive_mla_dense
from tests._testing import assert_close

D, V_DIM, PAGE = 576, 512, 64
SCALE = 192**-0.5


@pytest.fixture(autouse=True)
def fresh_flashmla(monkeypatch, tmp_path):
    """No library (a path that does not exist), the default setting; state forgotten before and after."""
    monkeypatch.setenv(config.FLASHMLA_LIB_ENV, str(tmp_path / "missing" / "libflashmla_dense.so"))
    monkeypatch.delenv("HELIXSERVE_MLA_BACKEND", raising=False)
    flashmla.reset()
    yield
    flashmla.reset()


def decode_case(seq_lens: list[int], H: int = 2, *, dtype=torch.bfloat16, page: int = PAGE, seed: int = 0):
    """One decode query per sequence over shuffled pages of a NaN-filled cache; the dense keys for the reference."""
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-L // page) for L in seq_lens) + 1
    num_blocks = sum(-(-L // page) for L in seq_lens) + 2
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.full((len(seq_lens), max_blocks), -1, dtype=torch.int32)
    cache = torch.full((num_blocks, page, D), float("nan"), dtype=dtype)
    keys = []
    for i, L in enumerate(seq_lens):
        k = torch.randn(L, D, generator=gen).to(dtype)
        keys.append(k)
        for b in range(-(-L // page)):
            tables[i, b] = free.pop()
            rows = k[b * page:(b + 1) * page]
            cache[tables[i, b], :rows.shape[0]] = rows
    B = len(seq_lens)
    q = torch.randn(B, H, D, generator=gen).to(dtype)
    kv_lens = torch.tensor(seq_lens)
    return (q, cache, tables, torch.arange(B + 1), kv_lens - 1, kv_lens), keys


def reference(args, keys):
    q, _, _, cu, pos, _ = args
    return naive_mla_dense(q, keys, cu, pos, SCALE, V_DIM)


def assert_matches_reference(args, keys, o, lse) -> None:
    o_ref, lse_ref = reference(args, keys)
    assert o.shape == o_ref.shape and lse.shape == lse_ref.shape and lse.dtype == torch.float32
    assert_close("o", o_ref, o.float(), 1e-2)
    assert_close("lse", lse_ref, lse, 1e-4)


class FakeKernel:
    """Stands in for the library's kernel: records that dispatch chose it and answers with the reference."""

    def __init__(self, keys):
        self.calls, self.keys = 0, keys

    def __call__(self, q, kv_cache, block_tables, kv_lens, scale, v_dim):
        self.calls += 1
        o, lse = naive_mla_dense(q, self.keys, torch.arange(q.shape[0] + 1), kv_lens - 1, scale, v_dim)
        return o.to(q.dtype), lse


def pretend_available(monkeypatch, keys) -> FakeKernel:
    """As on an H200 with the library built: available everywhere, the kernel replaced by the fake."""
    fake = FakeKernel(keys)
    monkeypatch.setattr(flashmla, "unavailable_reason", lambda device: None)
    monkeypatch.setattr(flashmla, "paged_decode", fake)
    return fake


def test_library_missing_takes_the_reference_path(caplog):
    args, keys = decode_case([70, 1, 130])
    with caplog.at_level(logging.INFO, logger=flashmla.__name__):
        o, lse = mla_paged_attention(*args, scale=SCALE, v_dim=V_DIM, is_decode=True)
        mla_paged_attention(*args, scale=SCALE, v_dim=V_DIM, is_decode=True)
    assert_matches_reference(args, keys, o, lse)
    o_plain, lse_plain = mla_paged_attention(*args, scale=SCALE, v_dim=V_DIM)
    assert torch.equal(o, o_plain) and torch.equal(lse, lse_plain)
    reason = flashmla.skip_reason(args[0], args[1], args[2], args[5], V_DIM)
    assert reason is not None and "no FlashMLA library at" in reason and "missing" in reason
    logged = [r.getMessage() for r in caplog.records if "MLA decode backend" in r.getMessage()]
    assert len(logged) == 1 and "not FlashMLA" in logged[0], logged  # logged once
    assert not flashmla.available(torch.device("cpu"))


def test_forced_flashmla_without_the_library_is_a_named_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HELIXSERVE_MLA_BACKEND", "flashmla")
    flashmla.reset()
    args, _ = decode_case([5])
    with pytest.raises(flashmla.FlashMLAUnavailable, match="HELIXSERVE_MLA_BACKEND=flashmla but no FlashMLA library at"):
        mla_paged_attention(*args, scale=SCALE, v_dim=V_DIM, is_decode=True)
    with pytest.raises(flashmla.FlashMLAUnavailable):  # any call: the deployment asked for FlashMLA
        mla_paged_attention(*args, scale=SCALE, v_dim=V_DIM)
    not_a_library = tmp_path / "libflashmla_dense.so"
    not_a_library.write_text("not an ELF file")
    monkeypatch.setenv(config.FLASHMLA_LIB_ENV, str(not_a_library))
    flashmla.reset()
    with pytest.raises(flashmla.FlashMLAUnavailable, match="cannot load the FlashMLA library"):
        mla_paged_attention(*args, scale=SCALE, v_dim=V_DIM, is_decode=True)


def test_backend_setting_is_validated_and_triton_never_takes_flashmla(monkeypatch):
    with pytest.raises(ValueError, match="HELIXSERVE_MLA_BACKEND must be one of"):
        config.mla_backend({"HELIXSERVE_MLA_BACKEND": "cutlass"})
    assert config.mla_backend({}) == "auto"
    assert config.flashmla_library({"HELIXSERVE_FLASHMLA_LIB": "/x/lib.so"}) == Path("/x/lib.so")
    assert config.flashmla_library({}).name == "libflashmla_dense.so"
    args, keys = decode_case([70, 3])
    fake = pretend_available(monkeypatch, keys)
    monkeypatch.setenv("HELIXSERVE_MLA_BACKEND", "triton")
    flashmla.setting.cache_clear()
    o, lse = mla_paged_attention(*args, scale=SCALE, v_dim=V_DIM, is_decode=True)
    assert fake.calls == 0
    assert_matches_reference(args, keys, o, lse)


def test_decode_shapes_flashmla_takes_go_to_it(monkeypatch):
    args, keys = decode_case([70, 1, 130], H=3)
    fake = pretend_available(monkeypatch, keys)
    o, lse = mla_paged_attention(*args, scale=SCALE, v_dim=V_DIM, is_decode=True)
    assert fake.calls == 1
    assert_matches_reference(args, keys, o, lse)
    mla_paged_attention(*args, scale=SCALE, v_dim=V_DIM)  # not declared a decode: never FlashMLA
    assert fake.calls == 1


def _strided_q(args):
    q = args[0]
    wide = torch.zeros(q.shape[0], q.shape[1], 2 * D, dtype=q.dtype)
    wide[..., ::2] = q
    return (wide[..., ::2], *args[1:])  # the same values, last-dim stride 2


@pytest.mark.parametrize("case", ["float32", "page16", "v_dim256", "strided_q", "no_blocks"])
def test_shapes_flashmla_cannot_take_fall_back(monkeypatch, case):
    v_dim = 256 if case == "v_dim256" else V_DIM
    args, keys = decode_case([70, 1, 20], dtype=torch.float32 if case == "float32" else torch.bfloat16,
                             page=16 if case == "page16" else PAGE)
    if case == "strided_q":
        args = _strided_q(args)
    if case == "no_blocks":  # kv_lens 0 everywhere and a zero-width table
        q, cache = args[0], args[1]
        args = (q, cache, torch.zeros(q.shape[0], 0, dtype=torch.int32), args[3], torch.full((q.shape[0],), -1),
                torch.zeros(q.shape[0], dtype=torch.int64))
        keys = [k[:0] for k in keys]
    fake = pretend_available(monkeypatch, keys)
    assert flashmla.unsupported_reason(args[0], args[1], args[2], args[5], v_dim) is not None
    o, lse = mla_paged_attention(*args, scale=SCALE, v_dim=v_dim, is_decode=True)
    assert fake.calls == 0
    o_ref, lse_ref = naive_mla_dense(args[0], keys, args[3], args[4], SCALE, v_dim)
    assert_close("o", o_ref, o.float(), 1e-2 if args[0].dtype == torch.bfloat16 else 1e-5)
    assert_close("lse", lse_ref, lse, 1e-4)


def test_the_real_kernel_refuses_shapes_it_cannot_run():
    args, _ = decode_case([70], dtype=torch.float32)
    with pytest.raises(flashmla.FlashMLAShapeError, match="bfloat16"):
        flashmla.paged_decode(args[0], args[1], args[2], args[5], SCALE)
    args, _ = decode_case([70])
    with pytest.raises(flashmla.FlashMLAShapeError, match="v_dim 256"):
        flashmla.paged_decode(args[0], args[1], args[2], args[5], SCALE, 256)
    with pytest.raises(flashmla.FlashMLAUnavailable, match="not a CUDA device"):
        flashmla.paged_decode(args[0], args[1], args[2], args[5], SCALE)


def test_a_decode_flag_with_several_rows_per_sequence_is_refused():
    args, _ = decode_case([70, 5])
    q, cache, tables, _, _, kv_lens = args
    q2 = torch.cat([q, q])
    with pytest.raises(ValueError, match="is_decode: q has 4 rows for 2 sequences"):
        mla_paged_attention(q2, cache, tables, torch.tensor([0, 2, 4]), torch.tensor([68, 69, 3, 4]), kv_lens,
                            scale=SCALE, v_dim=V_DIM, is_decode=True)


@pytest.mark.parametrize("num_ranks", [1, 2, 3])
def test_compacted_tables_attend_like_the_tables_with_holes(num_ranks):
    """Helix ownership (-1 on other ranks' blocks), a row with no key, a fully remote row and stale
    entries past kv_len: attending over the compacted tables, every query seeing all of its compacted
    keys, equals attending over the original ones."""
    page, H, Dk, Vd = 4, 3, 12, 8
    gen = torch.Generator().manual_seed(num_ranks)
    seq_lens = [13, 1, 0, 8, 23, 4]
    B, max_blocks = len(seq_lens), 7
    num_blocks = 48
    cache = torch.randn(num_blocks, page, Dk, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[:B * max_blocks].view(B, max_blocks).to(torch.int32)
    logical = torch.arange(max_blocks)
    tables = torch.where(logical % num_ranks == 0, tables, -1)
    tables[5] = -1  # a CUDA-graph padding row: nothing held
    q = torch.randn(B, H, Dk, generator=gen)
    kv_lens = torch.tensor(seq_lens)
    cu = torch.arange(B + 1)
    o, lse = mla_paged_attention(q, cache, tables, cu, kv_lens - 1, kv_lens, scale=SCALE, v_dim=Vd)
    compact, lens = flashmla.compact_tables(tables, kv_lens, page)
    assert compact.dtype == torch.int32 and lens.dtype == torch.int32 and compact.shape == tables.shape
    assert bool((compact >= 0).all()) and bool((compact < num_blocks).all())
    held_keys = [sum(min(page, max(0, L - j * page)) for j in range(max_blocks) if j % num_ranks == 0)
                 for L in seq_lens]
    held_keys[5] = 0
    assert lens.tolist() == held_keys
    o_c, lse_c = mla_paged_attention(q, cache, compact, cu, lens.long() - 1, lens.long(), scale=SCALE, v_dim=Vd)
    assert_close("o", o, o_c, 1e-6)
    assert_close("lse", lse, lse_c, 1e-6)
    if num_ranks == 1:  # nothing to move: the held prefix is the table itself
        for i, L in enumerate(seq_lens[:5]):
            n = -(-L // page)
            assert torch.equal(compact[i, :n], tables[i, :n])


def test_no_key_rows_get_our_lse_convention():
    lse = torch.tensor([[1.5, float("inf")], [-2.0, float("inf")]])
    out = flashmla.to_our_lse(lse)
    assert out.tolist() == [[1.5, float("-inf")], [-2.0, float("-inf")]]


def test_a_built_library_loads_and_speaks_our_c_api(monkeypatch):
    monkeypatch.delenv(config.FLASHMLA_LIB_ENV)
    flashmla.reset()
    if not flashmla.library_path().is_file():
        pytest.skip(f"no FlashMLA library at {flashmla.library_path()} (make flashmla)")
    lib = flashmla.load()
    assert lib.flashmla_capi_version() == flashmla.CAPI_VERSION
    assert flashmla.unavailable_reason(torch.device("cpu")) == "cpu is not a CUDA device"
