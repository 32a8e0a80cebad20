"""float8 e4m3 in the Triton kernels (on CPU tensors under Triton's interpreter): every code
decoded and a float32 range encoded as torch's cast does; the KV store writing an FP8
cache's codes as `write_kv` does (model/kv_fp8.py's quantizer); decode and prefill over an
FP8 cache against SDPA over the same codes dequantized by kv_fp8.py; and the blockwise FP8
GEMM against a float64 product over the weight dequantized by quantization/fp8.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from hotswap.model.attention import write_kv
from hotswap.model.cuda.fp8_kernels import E4M3, E5M2, kv_codes, kv_values
from hotswap.model.kv_fp8 import FP8_KV_DTYPE, dequantize_kv, quantize_kv
from hotswap.model.quantized import Fp8Layout, fp8_linear
from tests.model.cuda.conftest import DEVICE, ops
from tests.model.cuda.test_kernels import TOLERANCE, paged_cache, reference
from tests.model.test_fp8 import fused_weight

SCALES = [(1.0, 1.0), (0.37, 2.5)]
E5M2_DTYPE = torch.float8_e5m2


@triton.jit
def _round_trip_kernel(x_ptr, codes_ptr, values_ptr, N: tl.constexpr, FP8: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(codes_ptr + i, kv_codes(tl.load(x_ptr + i), FP8))
    tl.store(values_ptr + i, kv_values(tl.load(codes_ptr + i), FP8))


@pytest.mark.parametrize(("fmt", "dtype", "limit"), [(E4M3, FP8_KV_DTYPE, 448.0),
                                                     (E5M2, E5M2_DTYPE, 57344.0)],
                         ids=["e4m3", "e5m2"])  # fmt: skip
def test_codes_decode_and_encode_as_torchs_cast(fmt: int, dtype: torch.dtype, limit: float) -> None:
    """All 256 codes' values, and float32 inputs (every finite value, the midpoints between
    neighbours, subnormals, -0.0, beyond the largest) rounded to nearest even and
    saturated."""
    every = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    finite = every[every.isfinite()].sort().values
    mids = (finite[1:] + finite[:-1]) / 2
    gen = torch.Generator().manual_seed(0)
    spread = torch.randn(400, generator=gen) * torch.logspace(-7, 5, 400)
    beyond = [-0.0, limit * 1.01, limit * 1.04, -1e9, 2**-10, 2**-17, 3 * 2**-17]
    x = torch.cat([finite, mids, spread, torch.tensor(beyond)])
    n = triton.next_power_of_2(x.numel())
    padded = torch.zeros(n)
    padded[: x.numel()] = x
    padded = padded.to(DEVICE)
    codes = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    values = torch.empty(n, device=DEVICE)
    _round_trip_kernel[(1,)](padded, codes, values, N=n, FP8=fmt)
    want = padded.clamp(-limit, limit).to(dtype)
    assert torch.equal(codes, want.view(torch.uint8))
    assert torch.equal(values, want.float())
    assert codes[: finite.numel()].view(dtype).float().equal(finite.to(DEVICE))


CODES = pytest.mark.parametrize("codes", [FP8_KV_DTYPE, E5M2_DTYPE], ids=["e4m3", "e5m2"])


@CODES
@pytest.mark.parametrize("scales", SCALES, ids=["unit", "scaled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_quantizes_into_an_fp8_cache(scales, dtype: torch.dtype, codes) -> None:  # noqa: ANN001
    blocks, block_size, kv_heads, dim = 6, 16, 2, 32
    shape = (blocks, block_size, kv_heads, dim)
    k_cache = torch.zeros(shape, dtype=codes, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    qkv = (torch.randn(5, 8 * dim, device=DEVICE) * 200).to(dtype)  # some saturate
    key = qkv[:, 4 * dim : 6 * dim].view(5, kv_heads, dim)
    value = qkv[:, 6 * dim :].view(5, kv_heads, dim)
    key[0, 0, :4] = torch.tensor([1e-4, -3e-3, 0.0, 1.0625], dtype=dtype)
    slots = torch.tensor([0, 17, -1, 95, 40], device=DEVICE)  # row 2 is padding
    ops.store_kv_(key, value, k_cache, v_cache, slots, *scales)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    real = slots >= 0
    write_kv(key[real], value[real], (want_k, want_v), slots[real], scales)
    assert torch.equal(k_cache.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), want_v.view(torch.uint8))


def test_store_kv_divides_by_the_scale_as_quantize_kv() -> None:
    """Inputs a float32 ulp or two around (a midpoint between e4m3 values) x scale: which
    code they get depends on value / scale rounded as one IEEE division (a product with
    the scale's reciprocal rounds some of them the other way)."""
    scale = 0.37
    every = torch.arange(256, dtype=torch.uint8).view(FP8_KV_DTYPE).float()
    finite = every[~every.isnan()].sort().values
    centre = (finite[1:] + finite[:-1]) / 2 * scale
    up, down = torch.nextafter(centre, centre + 1), torch.nextafter(centre, centre - 1)
    near = [centre, up, down, torch.nextafter(up, up + 1), torch.nextafter(down, down - 1)]
    x = torch.cat(near)
    x = torch.cat([x, x.new_zeros((-x.numel()) % 32)]).view(-1, 1, 32).to(DEVICE)
    tokens = x.shape[0]
    k_cache = torch.zeros(tokens, 1, 1, 32, dtype=FP8_KV_DTYPE, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    ops.store_kv_(x, x, k_cache, v_cache, torch.arange(tokens, device=DEVICE), scale, 1.0)
    want = quantize_kv(x, scale, FP8_KV_DTYPE).view(torch.uint8)
    assert torch.equal(k_cache.view(torch.uint8).view(want.shape), want)


def test_scales_apply_to_fp8_caches_only() -> None:
    k_cache = torch.zeros(2, 16, 1, 16, device=DEVICE)
    key = torch.randn(1, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="FP8 caches only"):
        ops.store_kv_(key, key, k_cache, k_cache.clone(), torch.tensor([0], device=DEVICE),
                      0.5, 1.0)  # fmt: skip


def fp8_cache(lengths: list[int], kv_heads: int, dim: int, block_size: int,
              scales: tuple[float, float], dtype: torch.dtype, seed: int = 0,
              codes: torch.dtype = FP8_KV_DTYPE):  # fmt: skip
    """FP8 caches (`codes`: e4m3 or e5m2) of keys and values of a few units (codes of
    value / scale), the same read back by kv_fp8.py in `dtype`, and the block tables."""
    k, v, tables = paged_cache(lengths, kv_heads, dim, block_size, torch.float32, seed)
    k_codes = quantize_kv(k * 3, scales[0], codes)
    v_codes = quantize_kv(v * 3, scales[1], codes)
    k_ref = dequantize_kv(k_codes, scales[0], dtype)
    v_ref = dequantize_kv(v_codes, scales[1], dtype)
    return k_codes, v_codes, k_ref, v_ref, tables


def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """The kernels fold the scales into the score scale and the output (the reference
    rounds code x scale to the dtype first), over values of a few units: float32's
    tolerance x 4; bf16's absolute one as the CPU kernels' FP8 tests take it
    (tests/model/test_kv_fp8.py: 2^-8 of values ~3x)."""
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got.float(), want.float(), atol=5e-2, rtol=TOLERANCE[dtype])
    else:
        tol = 4 * TOLERANCE[dtype]
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@CODES
@pytest.mark.parametrize("scales", SCALES, ids=["unit", "scaled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "splits"), [(4, 2, 1), (8, 1, 3)])
def test_decode_over_an_fp8_cache(
    scales,
    dtype,
    heads: int,
    kv_heads: int,
    splits: int,  # noqa: ANN001
    codes,
) -> None:  # noqa: ANN001
    dim, block_size = 32, 16
    lengths = [1, 17, 64, 131]
    k_codes, v_codes, k_ref, v_ref, tables = fp8_cache(lengths, kv_heads, dim, block_size,
                                                       scales, dtype, codes=codes)  # fmt: skip
    q = torch.randn(len(lengths), heads, dim).to(dtype).to(DEVICE)
    out = torch.full((len(lengths), heads, dim), float("nan"), dtype=dtype, device=DEVICE)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    ops.paged_decode_(out, q, k_codes.to(DEVICE), v_codes.to(DEVICE), tables, lens, dim**-0.5,
                      splits, 16, *scales)  # fmt: skip
    for i, length in enumerate(lengths):
        want = reference(q[i : i + 1], k_ref.to(DEVICE), v_ref.to(DEVICE), tables[i], length,
                         dim**-0.5)[0]  # fmt: skip
        close(out[i], want, dtype)


@CODES
@pytest.mark.parametrize("scales", SCALES, ids=["unit", "scaled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("aligned", [False, True])
def test_prefill_over_an_fp8_cache(scales, dtype: torch.dtype, aligned: bool, codes) -> None:  # noqa: ANN001
    """A whole prompt, a chunk after a cached prefix that ends mid-block, a chunk longer
    than a query tile; GQA."""
    heads, kv_heads, dim, block_size, block_m = 4, 2, 32, 16, 16
    lengths, query_lens = [21, 53, 90], [21, 20, 37]
    k_codes, v_codes, k_ref, v_ref, tables = fp8_cache(lengths, kv_heads, dim, block_size,
                                                       scales, dtype, 1, codes)  # fmt: skip
    q = torch.randn(sum(query_lens), heads, dim).to(dtype).to(DEVICE)
    starts = [0, 21, 41]
    first_positions = [n - q for n, q in zip(lengths, query_lens)] if aligned else None
    seqs, firsts = ops.prefill_tiles(query_lens, block_m, first_positions)
    out = torch.full_like(q, float("nan"))
    as_tensor = lambda values: torch.tensor(values, dtype=torch.int32, device=DEVICE)  # noqa: E731
    ops.paged_prefill_(out, q, k_codes.to(DEVICE), v_codes.to(DEVICE), tables,
                       as_tensor(starts), as_tensor(query_lens), as_tensor(lengths),
                       as_tensor(seqs), as_tensor(firsts), dim**-0.5, block_m, 16,
                       *scales)  # fmt: skip
    for i, (start, count) in enumerate(zip(starts, query_lens)):
        rows = slice(start, start + count)
        want = reference(q[rows], k_ref.to(DEVICE), v_ref.to(DEVICE), tables[i], lengths[i],
                         dim**-0.5)  # fmt: skip
        close(out[rows], want, dtype)


GEMM_WEIGHTS = [
    ([200], 300, (128, 128)),  # K: two whole blocks and a partial one; N: one partial
    ([96, 32, 32], 72, (16, 16)),  # a fused layer, each shard on its own grid
    ([48, 40], 100, (32, 48)),  # block_k 48: K tiles of 16 within a block
]


@pytest.mark.parametrize("rows", [1, 5, 16, 65])
@pytest.mark.parametrize(("sizes", "k", "block"), GEMM_WEIGHTS)
def test_fp8_gemm_equals_the_dequantized_product(rows: int, sizes, k: int, block) -> None:  # noqa: ANN001
    codes, scales, layout, values = fused_weight(sizes, k, block)
    x = torch.randn(rows, k).to(DEVICE)
    args = (codes.to(DEVICE), scales.to(DEVICE), layout.scale_rows.to(DEVICE), block[1])
    out = ops.fp8_gemm(x, *args)
    want = x.double() @ values.double().t().to(DEVICE)
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    for dtype in (torch.bfloat16, torch.float16):
        low = x.to(dtype)
        out = ops.fp8_gemm(low, *args)
        assert out.dtype == dtype
        want = low.double() @ values.double().t().to(DEVICE)
        torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)


def test_fp8_linear_runs_every_batch_through_the_gemm(monkeypatch) -> None:  # noqa: ANN001
    """On the CUDA path's kernels, prefill-sized batches too read the codes in place: the
    weight is never dequantized. A strided input, leading dims and a bias."""

    def dequantized(*args) -> None:  # noqa: ANN002
        raise AssertionError("the weight was dequantized")

    codes, scales, layout, values = fused_weight([64, 16, 16], 48, (16, 16))
    layout = dataclasses.replace(layout, scale_rows=layout.scale_rows.to(DEVICE),
                                 kernels=ops.layer_kernels())  # fmt: skip
    monkeypatch.setattr(Fp8Layout, "dequantize", dequantized)
    bias = torch.randn(96, device=DEVICE)
    for rows in (1, 40):
        wide = torch.randn(rows, 2, 60, device=DEVICE)
        x = wide[..., :48]
        out = fp8_linear(x, codes.to(DEVICE), scales.to(DEVICE), layout, bias)
        want = x.double() @ values.double().t().to(DEVICE) + bias.double()
        assert out.shape == (rows, 2, 96)
        torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-5)
