"""The FP8 KV cache (--kv-cache-dtype fp8 = fp8_e4m3, fp8_e5m2): the quantizer's arithmetic
against torch's own float8 casts, the CPU decode kernels and every torch attention path
against a float64 reference over keys and values quantized and dequantized the same way
(vLLM's: value / scale saturated to the format's largest finite value, +-448 or +-57344,
rounded to nearest even; read back as code x scale)."""

from __future__ import annotations

import shutil

import pytest
import torch

from hotswap.model.attention import (
    BatchInvariantAttention,
    CacheSpec,
    SequenceSlice,
    TorchPagedAttention,
    build_metadata,
    gather_context,
)
from hotswap.model.attention_kernel import PagedKernelAttention, untile
from hotswap.model.kernels import CpuKernels, load_cpu_kernels
from hotswap.model.kv_fp8 import (
    FP8_KV_DTYPE,
    FP8_KV_DTYPES,
    dequantize_kv,
    quantize_kv,
    split_kv_scales,
)
from tests.model.test_kernels import (
    LENS,
    SHAPES,
    TILED_SHAPES,
    needs_tiles,
    random_batch,
    reference_decode,
    tiled_copy,
)

needs_compiler = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="no C++ compiler: the engine runs on torch operators here",
)
SCALES = [(1.0, 1.0), (0.37, 2.5)]
E5M2 = FP8_KV_DTYPES["fp8_e5m2"]
CODES = pytest.mark.parametrize("codes", list(FP8_KV_DTYPES.values()), ids=["e4m3", "e5m2"])


def test_quantize_saturates_and_rounds_to_nearest_even() -> None:
    x = torch.tensor([1000.0, -1000.0, 448.0, 0.0, 1.0625, 1.1875, 3e-3, -2e-4])
    codes = quantize_kv(x, 1.0, FP8_KV_DTYPE)
    assert codes.dtype == FP8_KV_DTYPE
    # 1.0625 lies halfway between 1.0 and 1.125: even mantissa (1.0); 1.1875 -> 1.25
    want = [448.0, -448.0, 448.0, 0.0, 1.0, 1.25, 2**-8, 0.0]  # subnormal steps of 2^-9
    assert codes.float().tolist() == want
    halved = quantize_kv(x, 2.0, FP8_KV_DTYPE)  # value / scale
    assert halved.float().tolist() == quantize_kv(x / 2, 1.0, FP8_KV_DTYPE).float().tolist()
    doubled = [2 * w for w in halved.float().tolist()]
    assert dequantize_kv(halved, 2.0, torch.float32).tolist() == doubled


def test_e5m2_saturates_and_rounds_to_nearest_even() -> None:
    x = torch.tensor([6e4, -1e6, 57344.0, 1.125, 1.375, -1.625, 2.0**-17, 3 * 2.0**-17, 0.0])
    codes = quantize_kv(x, 1.0, E5M2)
    assert codes.dtype == E5M2
    # two mantissa bits: 1.125 is halfway between 1.0 and 1.25 (even: 1.0), 1.375 between
    # 1.25 and 1.5 (even: 1.5); subnormal steps of 2^-16, halfway rounds to even too
    want = [57344.0, -57344.0, 57344.0, 1.0, 1.5, -1.5, 0.0, 2.0**-15, 0.0]
    assert codes.float().tolist() == want
    assert torch.isnan(quantize_kv(torch.tensor([float("nan")]), 1.0, E5M2).float()).all()


@CODES
def test_quantize_is_torchs_cast_within_range(codes: torch.dtype) -> None:
    """Bitwise torch's own float32 -> float8 cast of value / scale wherever it is finite,
    across many binades (subnormals included), for bf16 and float32 inputs."""
    generator = torch.Generator().manual_seed(1)
    bound = torch.finfo(codes).max
    powers = torch.randint(-24, 20, (4096,), generator=generator)
    x = torch.randn(4096, generator=generator) * 2.0**powers
    for inputs in (x, x.to(torch.bfloat16)):
        for scale in (1.0, 0.37, 3.0):
            theirs = (inputs.float() / scale).to(codes)
            finite = (inputs.float() / scale).abs() <= bound
            ours = quantize_kv(inputs, scale, codes)
            assert torch.equal(ours.view(torch.uint8)[finite], theirs.view(torch.uint8)[finite])
            assert (ours.float()[~finite].abs() == bound).all()  # saturated, not infinite
            assert finite.any() and (~finite).any()


def test_an_e5m2_code_is_the_high_byte_of_its_float16() -> None:
    """What the kernels read (fp8_codes.h): code << 8 as float16 bits is the code's value,
    for all 256 codes (infinities and NaNs as well)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E5M2)
    halves = (torch.arange(256, dtype=torch.int32) << 8).to(torch.int16).view(torch.float16)
    torch.testing.assert_close(halves.float(), codes.float(), rtol=0, atol=0, equal_nan=True)


@CODES
def test_dequantize_rounds_the_product_to_the_dtype(codes: torch.dtype) -> None:
    codes = quantize_kv(torch.randn(256, generator=torch.Generator().manual_seed(0)), 1.0, codes)
    want = (codes.double() * 0.37).to(torch.float32).to(torch.bfloat16)
    assert torch.equal(dequantize_kv(codes, 0.37, torch.bfloat16), want)
    assert torch.equal(dequantize_kv(codes, 1.0, torch.bfloat16), codes.to(torch.bfloat16))


def fp8_batch(heads, kv_heads, dim, block_size, lens, dtype, scales, codes):  # noqa: ANN001, ANN201
    """A random batch whose caches hold FP8 codes, and those caches dequantized (float64)."""
    q, k, v, tables, lens_t = random_batch(heads, kv_heads, dim, block_size, lens, dtype)
    k_codes, v_codes = quantize_kv(k * 3, scales[0], codes), quantize_kv(v * 3, scales[1], codes)
    k_ref = k_codes.double() * scales[0]
    v_ref = v_codes.double() * scales[1]
    return q, k_codes, v_codes, k_ref, v_ref, tables, lens_t


@needs_compiler
@CODES
@pytest.mark.parametrize("scales", SCALES, ids=["unit", "scaled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
def test_kernel_over_fp8_caches_matches_the_dequantized_reference(shape, dtype, scales,  # noqa: ANN001
                                                                  codes) -> None:  # fmt: skip
    assert load_cpu_kernels(progress=False)
    heads, kv_heads, dim, block_size = shape
    q, kc, vc, k_ref, v_ref, tables, lens = fp8_batch(heads, kv_heads, dim, block_size, LENS,
                                                      dtype, scales, codes)  # fmt: skip
    scale = dim**-0.5
    out = torch.ops.hotswap_cpu.paged_decode_attention(q, kc, vc, tables, lens, scale, *scales)
    assert out.dtype == dtype
    expected = reference_decode(q, k_ref, v_ref, tables, lens, scale)
    # float32 arithmetic over exact inputs; bf16: the output rounded (2^-8 of values ~3 x)
    atol = 5e-2 if dtype == torch.bfloat16 else 2e-5 * max(scales[1], 1.0)
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)


@needs_tiles
@CODES
@pytest.mark.parametrize("scales", SCALES, ids=["unit", "scaled"])
@pytest.mark.parametrize("shape", TILED_SHAPES, ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
def test_tiled_kernel_over_fp8_caches_matches_the_dequantized_reference(shape, scales,  # noqa: ANN001
                                                                        codes) -> None:  # fmt: skip
    """bf16 queries over an FP8 cache kept in tiles (codes written by write_kv_tiles); the
    same codes read by the natural-layout kernel agree too."""
    ops = torch.ops.hotswap_cpu
    heads, kv_heads, dim, block_size = shape
    q, kc, vc, k_ref, v_ref, tables, lens = fp8_batch(heads, kv_heads, dim, block_size, LENS,
                                                      torch.bfloat16, scales, codes)  # fmt: skip
    k_tiles, v_tiles = tiled_copy(ops, kc, vc)
    assert k_tiles.dtype == codes
    scale = dim**-0.5
    out = ops.paged_decode_attention_tiles(q, k_tiles, v_tiles, tables, lens, scale, *scales)
    expected = reference_decode(q, k_ref, v_ref, tables, lens, scale)
    # probabilities rounded to bf16 for the value products, the output to bf16
    torch.testing.assert_close(out.double(), expected, atol=5e-2, rtol=0)
    natural = ops.paged_decode_attention(q, kc, vc, tables, lens, scale, *scales)
    torch.testing.assert_close(out.double(), natural.double(), atol=5e-2, rtol=0)
    for table, length in zip(tables, lens.tolist()):  # untile gives the codes back
        seq = SequenceSlice(0, 1, length, table)
        keys, _ = untile(k_tiles, v_tiles, seq)
        assert torch.equal(keys.view(torch.uint8), gather_context(kc.view(torch.uint8), seq))
    with pytest.raises(RuntimeError, match="FP8 caches only"):
        bf16 = tiled_copy(ops, *(c.to(torch.bfloat16) for c in (kc, vc)))
        ops.paged_decode_attention_tiles(q, *bf16, tables, lens, scale, 0.5, 1.0)


def every_code(codes: torch.dtype, dim: int, block_size: int):  # noqa: ANN201
    """Caches whose position 0 of block b holds row b of every code of the format (e4m3's
    two NaN codes left out: its decode does not keep them, and a saturating write of a
    finite value never makes them), zero keys; one block per sequence, context length 1."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if codes == FP8_KV_DTYPE:
        values = values[(values & 0x7F) != 0x7F]
    rows = -(-len(values) // dim)
    v = torch.zeros(rows, block_size, 1, dim, dtype=torch.uint8)
    v[:, 0, 0] = values.repeat(2)[: rows * dim].view(rows, dim)
    k = torch.zeros_like(v)
    return (
        k.view(codes),
        v.view(codes),
        torch.arange(rows).view(rows, 1),
        torch.ones(rows, dtype=torch.long),
    )


@needs_compiler
@CODES
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [48, 64], ids=["tail", "vectors"])
def test_kernel_reads_every_code_exactly(codes, dtype, dim) -> None:  # noqa: ANN001
    """With one position, the output is its value row x v_scale, one float32 product
    rounded to the dtype: every code decoded exactly (infinities and NaNs of e5m2 too)."""
    assert load_cpu_kernels(progress=False)
    kc, vc, tables, lens = every_code(codes, dim, 4)
    q = torch.randn(len(lens), 2, dim, generator=torch.Generator().manual_seed(2)).to(dtype)
    out = torch.ops.hotswap_cpu.paged_decode_attention(q, kc, vc, tables, lens, 0.1, 0.5, 0.37)
    want = (vc[:, 0].float() * torch.tensor(0.37)).to(dtype).expand(-1, 2, -1)
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)


@needs_tiles
@CODES
def test_tiled_kernel_reads_every_code_exactly(codes) -> None:  # noqa: ANN001
    kc, vc, tables, lens = every_code(codes, 64, 16)
    k_tiles, v_tiles = tiled_copy(torch.ops.hotswap_cpu, kc, vc)
    q = torch.randn(len(lens), 2, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    out = torch.ops.hotswap_cpu.paged_decode_attention_tiles(q, k_tiles, v_tiles, tables, lens,
                                                             0.1, 0.5, 0.37)  # fmt: skip
    want = (vc[:, 0].float() * torch.tensor(0.37)).bfloat16().expand(-1, 2, -1)
    torch.testing.assert_close(out, want, rtol=0, atol=0, equal_nan=True)


@needs_compiler
def test_kernel_refuses_scales_on_a_model_dtype_cache_and_mixed_caches() -> None:
    assert load_cpu_kernels(progress=False)
    ops = torch.ops.hotswap_cpu
    q, k, v, tables, lens = random_batch(4, 2, 16, 8, [5], torch.float32)
    with pytest.raises(RuntimeError, match="FP8 caches only"):
        ops.paged_decode_attention(q, k, v, tables, lens, 0.25, 0.5, 1.0)
    with pytest.raises(RuntimeError, match="float8_e4m3fn or float8_e5m2"):
        ops.paged_decode_attention(q, quantize_kv(k, 1.0, E5M2), v, tables, lens, 0.25, 1.0, 1.0)


def reference_attention(query, keys, values, scale) -> torch.Tensor:  # noqa: ANN001
    """float64 causal attention of one sequence's last queries over its [L, kv, D] context."""
    n, heads, length = query.shape[0], query.shape[1], keys.shape[0]
    group = heads // keys.shape[1]
    keys = keys.double().repeat_interleave(group, dim=1)
    values = values.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,lhd->hql", query.double(), keys) * scale
    positions = torch.arange(length - n, length)
    mask = torch.arange(length)[None, :] > positions[:, None]
    scores = scores.masked_fill(mask[None], float("-inf"))
    return torch.einsum("hql,lhd->qhd", scores.softmax(-1), values)


def backends() -> list:
    made = [TorchPagedAttention(), BatchInvariantAttention()]
    kernels = CpuKernels.load(progress=False) if shutil.which("c++") else None
    return made + ([PagedKernelAttention(kernels)] if kernels is not None else [])


@CODES
@pytest.mark.parametrize("scales", SCALES, ids=["unit", "scaled"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", backends(), ids=lambda b: type(b).__name__)
def test_backends_write_codes_and_attend_over_them(backend, dtype, scales, codes) -> None:  # noqa: ANN001
    """Two steps over an FP8 cache: prompts (one crossing blocks), then a mixed step of
    decodes and a chunk with cached context; each against the float64 reference over K/V
    quantized and dequantized; the cache holds exactly the quantized codes."""
    heads, kv_heads, dim, bs = 6, 2, 16, 8
    spec = CacheSpec(bs, heads, kv_heads, dim, codes, torch.device("cpu"))
    cache = backend.make_cache(24, spec)
    assert cache[0].dtype == codes
    generator = torch.Generator().manual_seed(3)
    tables = [[5, 2, 9], [3], [7, 1, 0, 11]]  # decode rows first, as the runner sorts them
    history = [(torch.empty(0, kv_heads, dim), torch.empty(0, kv_heads, dim)) for _ in tables]
    for query_lens, context_lens in (([19, 1, 3], [19, 1, 3]), ([1, 1, 9], [20, 2, 12])):
        total = sum(query_lens)
        q = torch.randn(total, heads, dim, generator=generator).to(dtype)
        k = (torch.randn(total, kv_heads, dim, generator=generator) * 4).to(dtype)
        v = (torch.randn(total, kv_heads, dim, generator=generator) * 4).to(dtype)
        slots, row, expected = [], 0, []
        for i, (n, length) in enumerate(zip(query_lens, context_lens)):
            slots += [tables[i][p // bs] * bs + p % bs for p in range(length - n, length)]
            # read back as the torch paths do: code x scale rounded to the dtype
            ks, vs = (dequantize_kv(quantize_kv(x[row : row + n], s, codes), s, dtype).double()
                      for x, s in ((k, scales[0]), (v, scales[1])))  # fmt: skip
            history[i] = (torch.cat([history[i][0], ks]), torch.cat([history[i][1], vs]))
            expected.append(reference_attention(q[row : row + n], *history[i], dim**-0.5))
            row += n
        meta = build_metadata(query_lens, context_lens, tables, torch.tensor(slots), bs,
                              dtype, decode_batch=backend.reads_decode_batch)  # fmt: skip
        out = backend.forward(q, k, v, cache, meta, dim**-0.5, scales)
        # bf16: values of a few units, rounded in SDPA's bf16 steps and the output
        tol = (2e-2, 1e-2) if dtype == torch.bfloat16 else (1e-5 * max(scales[1], 1), 0)
        torch.testing.assert_close(out.double(), torch.cat(expected), atol=tol[0], rtol=tol[1])
        flat = cache[0].view(-1, kv_heads, dim)
        want = quantize_kv(k, scales[0], codes)
        assert torch.equal(flat[torch.tensor(slots)].view(torch.uint8), want.view(torch.uint8))


def test_checkpoint_scales_in_vllm_spellings_are_taken_out() -> None:
    one = torch.tensor(0.5)
    items = [
        ("model.layers.0.self_attn.k_scale", one),
        ("model.layers.0.self_attn.attn.v_scale", torch.tensor([2.0])),
        ("model.layers.1.self_attn.k_proj.output_scale", torch.tensor(0.25)),
        ("model.layers.1.self_attn.v_proj.v_scale", torch.tensor(4.0)),
        ("model.layers.2.self_attn.kv_scale", torch.tensor(3.0)),
        ("model.layers.0.self_attn.k_proj.weight", one),
        ("model.layers.0.self_attn.k_proj.weight_scale_inv", one),
    ]
    found: dict[int, dict[str, float]] = {}
    rest = [name for name, _ in split_kv_scales(iter(items), found)]
    assert rest == ["model.layers.0.self_attn.k_proj.weight",
                    "model.layers.0.self_attn.k_proj.weight_scale_inv"]  # fmt: skip
    assert found == {0: {"k": 0.5, "v": 2.0}, 1: {"k": 0.25, "v": 4.0}, 2: {"k": 3.0, "v": 3.0}}
