"""hotswap's CPU kernels against independent references: paged decode attention against
float64 softmax attention over each sequence's gathered context, GEMV against a float64
matrix product. The natural-layout kernel (any dtype and shape) and, where this CPU has
AVX-512 BF16, the kernel over the tiled bf16 cache and the writes into it."""

from __future__ import annotations

import shutil

import pytest
import torch

from hotswap.model.attention import CacheSpec, SequenceSlice, gather_context
from hotswap.model.attention_kernel import tiled_cache, untile
from hotswap.model.kernels import CpuKernels, load_cpu_kernels

pytestmark = pytest.mark.skipif(
    shutil.which("c++") is None and shutil.which("g++") is None,
    reason="no C++ compiler: the engine runs on torch operators here",
)


@pytest.fixture(scope="module")
def ops():  # noqa: ANN201
    # With a compiler present the build must succeed: a silent fallback would hide a
    # broken kernel behind the torch path.
    assert load_cpu_kernels(progress=False)
    return torch.ops.hotswap_cpu


def reference_decode(q, k_cache, v_cache, tables, lens, scale) -> torch.Tensor:  # noqa: ANN001
    """float64 attention of each sequence's one query over its first `lens[b]` slots."""
    outs = []
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    for b in range(q.shape[0]):
        length = int(lens[b])
        keys = k_cache[tables[b]].flatten(0, 1)[:length].double()  # [L, kv_heads, D]
        values = v_cache[tables[b]].flatten(0, 1)[:length].double()
        keys = keys.repeat_interleave(heads // kv_heads, dim=1)  # [L, H, D]
        values = values.repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b].double(), keys) * scale
        outs.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), values))
    return torch.stack(outs)


def random_batch(heads, kv_heads, dim, block_size, lens, dtype, seed=0):  # noqa: ANN001, ANN201
    generator = torch.Generator().manual_seed(seed)
    max_blocks = -(-max(lens) // block_size)
    num_blocks = 4 * len(lens) * max_blocks
    shape = (num_blocks, block_size, kv_heads, dim)
    k_cache = torch.randn(shape, generator=generator).to(dtype)
    v_cache = torch.randn(shape, generator=generator).to(dtype)
    tables = torch.randperm(num_blocks, generator=generator)[: len(lens) * max_blocks]
    q = torch.randn(len(lens), heads, dim, generator=generator).to(dtype)
    return q, k_cache, v_cache, tables.view(len(lens), max_blocks), torch.tensor(lens)


SHAPES = [  # heads, kv_heads, head dim, block size
    (9, 3, 64, 16),  # SmolLM2: the bf16 fast path
    (16, 8, 128, 16),  # Qwen3-0.6B
    (8, 1, 64, 32),  # multi-query, larger blocks
    (4, 4, 80, 8),  # portable path: head size and block size the fast path does not take
    (12, 4, 16, 8),  # the tiny test models
]
LENS = [1, 15, 16, 17, 64, 150]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
def test_paged_decode_attention_matches_reference(ops, dtype, shape) -> None:  # noqa: ANN001
    heads, kv_heads, dim, block_size = shape
    q, k, v, tables, lens = random_batch(heads, kv_heads, dim, block_size, LENS, dtype)
    scale = dim**-0.5
    out = ops.paged_decode_attention(q, k, v, tables, lens, scale, 1.0, 1.0)
    expected = reference_decode(q, k, v, tables, lens, scale)
    # bf16: inputs are exact in float64; the output is rounded to bf16 (2^-8 relative)
    atol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), expected, atol=atol, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sequence_gets_the_same_bits_alone_or_in_a_batch(ops, dtype) -> None:  # noqa: ANN001
    # Small batches split work by kv head, large ones by sequence; neither may change a
    # sequence's result.
    lens = [37 + 13 * i for i in range(40)]
    q, k, v, tables, lens_t = random_batch(9, 3, 64, 16, lens, dtype)
    together = ops.paged_decode_attention(q, k, v, tables, lens_t, 0.125, 1.0, 1.0)
    for b in (0, 17, 39):
        alone = ops.paged_decode_attention(q[b : b + 1], k, v, tables[b : b + 1],
                                           lens_t[b : b + 1], 0.125, 1.0, 1.0)  # fmt: skip
        assert torch.equal(alone[0], together[b])


def test_query_rows_may_be_strided(ops) -> None:  # noqa: ANN001
    # The engine passes q as a view into the fused q/k projection output.
    q, k, v, tables, lens = random_batch(9, 3, 64, 16, [5, 40], torch.bfloat16)
    fused = torch.cat([q, torch.zeros(2, 3, 64, dtype=q.dtype)], dim=1)
    view = fused[:, :9]
    assert not view.is_contiguous()
    out = ops.paged_decode_attention(view, k, v, tables, lens, 0.125, 1.0, 1.0)
    assert torch.equal(out, ops.paged_decode_attention(q, k, v, tables, lens, 0.125, 1.0, 1.0))


def test_bad_tables_are_refused_not_read(ops) -> None:  # noqa: ANN001
    q, k, v, tables, lens = random_batch(9, 3, 64, 16, [20, 20], torch.bfloat16)
    bad = tables.clone()
    bad[1, 1] = k.shape[0]  # one past the last block
    with pytest.raises(RuntimeError, match="not in the cache"):
        ops.paged_decode_attention(q, k, v, bad, lens, 0.125, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.paged_decode_attention(q, k, v, tables, torch.tensor([20, 10_000]), 0.125, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.paged_decode_attention(q, k, v, tables, torch.tensor([0, 20]), 0.125, 1.0, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 960, 576), (1, 49, 33), (1, 7, 1536), (3, 130, 64)])
def test_gemv_matches_reference(ops, dtype, m, n, k) -> None:  # noqa: ANN001
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(m, k, generator=generator).to(dtype)
    w = torch.randn(n, k, generator=generator).to(dtype)
    expected = x.double() @ w.double().t()
    out = ops.gemv(x, w)
    assert out.dtype == dtype and out.shape == (m, n)
    # float32 sums of exact products; the output rounded to the dtype
    rtol = 2**-8 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.double(), expected, atol=1e-4 * k**0.5, rtol=rtol)


def test_gemv_refuses_mismatched_shapes(ops) -> None:  # noqa: ANN001
    with pytest.raises(RuntimeError, match="input \\[M, K\\] and weight \\[N, K\\]"):
        ops.gemv(torch.zeros(1, 8), torch.zeros(4, 9))


@pytest.mark.slow
@pytest.mark.parametrize("batch", [4, 16], ids=["gemv", "amx-or-packed"])
def test_engine_decode_through_the_kernels_matches_prefill_scores(
    ops,
    tiny_model_factory,
    batch: int,  # noqa: ANN001
) -> None:
    """bf16, head size 64, blocks of 16: the fast paths. Each greedy token's logprob as
    decoded (paged kernel, fused activation, and the GEMV for up to 8 rows or the AMX /
    packed GEMMs beyond, one token per step) equals, within bf16 rounding, its logprob
    when the whole sequence is scored at once by torch's SDPA and GEMM path."""
    from hotswap import LLM, SamplingParams

    model_dir = tiny_model_factory("llama", hidden_size=256, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=512)  # fmt: skip
    prompts = [[5 + i, 17, 99, 23 + 3 * i, 7] * (2 + i % 4) for i in range(batch)]
    fast = LLM(str(model_dir), dtype="bfloat16", block_size=16, progress=False)
    assert fast.engine.runner.kernels
    decoded = fast.generate(prompts, SamplingParams(temperature=0, max_tokens=20, logprobs=0,
                                                    ignore_eos=True), use_tqdm=False)  # fmt: skip
    torch_path = LLM(str(model_dir), dtype="bfloat16", block_size=16, cpu_kernels=False,
                     progress=False)  # fmt: skip
    assert not torch_path.engine.runner.kernels
    exact = LLM(str(model_dir), dtype="float32", block_size=16, progress=False)
    kernel_error = torch_error = 0.0  # the largest distance of each bf16 path from float32
    for out in decoded:
        tokens = out.outputs[0].token_ids
        request = [out.prompt_token_ids + tokens]
        params = SamplingParams(max_tokens=1, prompt_logprobs=0)
        start = len(out.prompt_token_ids)
        scored = torch_path.generate(request, params, use_tqdm=False)[0].prompt_logprobs[start:]
        truth = exact.generate(request, params, use_tqdm=False)[0].prompt_logprobs[start:]
        for token, step, reference, fp32 in zip(tokens, out.outputs[0].logprobs, scored, truth):
            assert abs(step[token].logprob - reference[token].logprob) < 0.1
            kernel_error = max(kernel_error, abs(step[token].logprob - fp32[token].logprob))
            torch_error = max(torch_error, abs(reference[token].logprob - fp32[token].logprob))
    # bf16 rounding differs by CPU (AMX, AVX-512 BF16 dot products, AVX2 emulation), so
    # the bound is relative: the kernels are no further from float32 than torch's own bf16
    # path (measured: 0.094 vs 0.093 on AVX-512 BF16; skipping one block of keys: 2.45).
    assert kernel_error <= 1.25 * torch_error + 0.02, (kernel_error, torch_error)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_embedding_rounds_as_the_torch_path(ops, dtype) -> None:  # noqa: ANN001
    from hotswap.model.layers import RotaryEmbedding, apply_rotary

    rope = RotaryEmbedding(64, 512, {"rope_theta": 10000.0, "rope_type": "default"})
    cos, sin = rope(torch.tensor([0, 3, 77, 511, 5]), dtype)
    fused = torch.randn(5, 16, 64).to(dtype)  # q/k heads inside a wider projection output
    qk = fused[:, :12]
    expected = apply_rotary(qk, (cos, sin))
    ops.rotary_embedding(qk, cos, sin)
    assert torch.equal(qk, expected)
    assert torch.equal(fused[:, 12:], fused[:, 12:].clone())  # untouched beyond the view


@pytest.mark.parametrize("weight_dtype", [None, torch.float32], ids=["same", "fp32-weight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_the_torch_path(ops, dtype, weight_dtype) -> None:  # noqa: ANN001
    from hotswap.model.layers import RMSNorm

    norm = RMSNorm(576, 1e-5, weight_dtype or dtype)
    norm.weight.data.copy_(torch.rand(576) + 0.5)
    x = (torch.randn(9, 576) * 3).to(dtype)
    residual = torch.randn(9, 576).to(dtype)
    expected = norm(x)
    expected_sum = residual + x
    expected_fused = norm(expected_sum)
    out = ops.rms_norm(x, norm.weight, norm.eps)
    fused = ops.add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(residual, expected_sum)  # the stream updated in place, rounded alike
    # Only the float32 sum of squares is added up in another order, which may move the
    # scale by a float32 ulp: both are as close to float64 arithmetic (a few ulps of the
    # output dtype), and in bf16 they mostly agree bit for bit.
    weight = norm.weight.double()
    for got, want, source in ((out, expected, x), (fused, expected_fused, expected_sum)):
        assert got.dtype == want.dtype
        s64 = source.double()
        exact = weight * s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + norm.eps)
        bound = 4 * torch.finfo(want.dtype).eps * exact.abs()
        assert ((got.double() - exact).abs() <= bound).all()
        assert ((want.double() - exact).abs() <= bound).all()
        if want.dtype == torch.bfloat16:
            assert (got == want).float().mean() > 0.95


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_silu_and_mul_rounds_as_torch(ops, dtype) -> None:  # noqa: ANN001
    """Against transformers' `act_fn(gate) * up` on torch's own kernels, bit for bit (an
    intermediate size of whole vectors: torch's scalar tail uses another exp), on a
    strided view as the GEMM's output may be, and against float64 within two roundings."""
    wide = (torch.randn(37, 2 * 1536 + 64) * 4).to(dtype)
    gate_up = wide[:, : 2 * 1536]  # rows with a stride beyond their length
    gate, up = gate_up.chunk(2, dim=-1)
    out = ops.silu_and_mul(gate_up)
    assert out.shape == (37, 1536) and out.is_contiguous()
    assert torch.equal(out, torch.nn.functional.silu(gate) * up)
    g64, u64 = gate.double(), up.double()
    exact = g64 * torch.sigmoid(g64) * u64
    info = torch.finfo(dtype)  # relative error, and float16's subnormal steps near zero
    bound = (3 * info.eps * (g64 * torch.sigmoid(g64)).abs() + info.smallest_normal) * u64.abs()
    bound += info.smallest_normal
    assert ((out.double() - exact).abs() <= bound).all()
    tail = (torch.randn(3, 2 * 40) * 4).to(dtype)  # 40 = a vector and a masked part
    got, want = ops.silu_and_mul(tail), torch.nn.functional.silu(tail[:, :40]) * tail[:, 40:]
    torch.testing.assert_close(got, want, rtol=2 * torch.finfo(dtype).eps, atol=1e-6)


def test_silu_and_mul_refuses_an_odd_width(ops) -> None:  # noqa: ANN001
    with pytest.raises(RuntimeError, match="silu_and_mul"):
        ops.silu_and_mul(torch.randn(4, 7))


# -- the tiled bf16 cache (csrc/paged_attention_tiles.cpp) ---------------------------------
needs_tiles = pytest.mark.skipif(
    not CpuKernels.tiles_apply(torch.bfloat16, 9, 3, 64, 16),
    reason="the tiled cache needs kernels built with AVX-512 BF16",
)
TILED_SHAPES = [s for s in SHAPES if s[2] in (64, 128) and s[3] % 16 == 0]


def tiled_copy(ops, k_cache, v_cache):  # noqa: ANN001, ANN201
    """The natural caches' contents written into tiled caches, slot by slot."""
    blocks, block_size, kv_heads, dim = k_cache.shape
    spec = CacheSpec(block_size, kv_heads, kv_heads, dim, k_cache.dtype, torch.device("cpu"))
    k_tiles, v_tiles = tiled_cache(blocks, spec)
    slots = torch.arange(blocks * block_size)
    ops.write_kv_tiles(k_cache.flatten(0, 1), v_cache.flatten(0, 1), k_tiles, v_tiles, slots)
    return k_tiles, v_tiles


@needs_tiles
@pytest.mark.parametrize("shape", TILED_SHAPES, ids=lambda s: "h{}kv{}d{}bs{}".format(*s))
def test_tiled_decode_attention_matches_reference(ops, shape) -> None:  # noqa: ANN001
    heads, kv_heads, dim, block_size = shape
    q, k, v, tables, lens = random_batch(heads, kv_heads, dim, block_size, LENS, torch.bfloat16)
    out = ops.paged_decode_attention_tiles(q, *tiled_copy(ops, k, v), tables, lens, dim**-0.5, 1, 1)
    expected = reference_decode(q, k, v, tables, lens, dim**-0.5)
    torch.testing.assert_close(out.double(), expected, atol=2e-2, rtol=0)


@needs_tiles
def test_tiled_sequence_gets_the_same_bits_alone_or_in_a_batch(ops) -> None:  # noqa: ANN001
    lens = [37 + 13 * i for i in range(40)]
    q, k, v, tables, lens_t = random_batch(9, 3, 64, 16, lens, torch.bfloat16)
    k_tiles, v_tiles = tiled_copy(ops, k, v)
    together = ops.paged_decode_attention_tiles(q, k_tiles, v_tiles, tables, lens_t, 0.125, 1, 1)
    for b in (0, 17, 39):
        rows = slice(b, b + 1)
        alone = ops.paged_decode_attention_tiles(q[rows], k_tiles, v_tiles, tables[rows],
                                                 lens_t[rows], 0.125, 1.0, 1.0)  # fmt: skip
        assert torch.equal(alone[0], together[b])
    view = torch.cat([q, torch.zeros_like(q[:, :3])], dim=1)[:, :9]  # rows of a fused output
    strided = ops.paged_decode_attention_tiles(view, k_tiles, v_tiles, tables, lens_t, 0.125, 1, 1)
    assert torch.equal(strided, together)


@needs_tiles
def test_tiles_hold_what_was_written_and_untile_gives_it_back(ops) -> None:  # noqa: ANN001
    _, k, v, tables, lens = random_batch(9, 3, 64, 32, [1, 31, 32, 33, 100], torch.bfloat16)
    k_tiles, v_tiles = tiled_copy(ops, k, v)
    for table, length in zip(tables, lens.tolist()):
        seq = SequenceSlice(0, 1, length, table)
        keys, values = untile(k_tiles, v_tiles, seq)
        assert torch.equal(keys, gather_context(k, seq))
        assert torch.equal(values, gather_context(v, seq))


@needs_tiles
def test_tiled_ops_refuse_bad_tables_and_slots(ops) -> None:  # noqa: ANN001
    q, k, v, tables, lens = random_batch(9, 3, 64, 16, [20, 20], torch.bfloat16)
    k_tiles, v_tiles = tiled_copy(ops, k, v)
    bad = tables.clone()
    bad[1, 1] = k.shape[0]
    with pytest.raises(RuntimeError, match="not in the cache"):
        ops.paged_decode_attention_tiles(q, k_tiles, v_tiles, bad, lens, 0.125, 1.0, 1.0)
    with pytest.raises(RuntimeError, match="does not fit"):
        ops.paged_decode_attention_tiles(q, k_tiles, v_tiles, tables, torch.tensor([0, 20]), 0.125,
                                         1.0, 1.0)  # fmt: skip
    before = k_tiles.clone()
    new = torch.ones(2, 3, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="slot 100000 is not in the cache"):
        ops.write_kv_tiles(new, new, k_tiles, v_tiles, torch.tensor([0, 100_000]))
    assert torch.equal(k_tiles, before)  # checked before any write


# -- AMX linear layers (csrc/amx_linear.cpp) -------------------------------------------------
def amx_or_skip(ops):  # noqa: ANN001, ANN201
    if not ops.amx_available():
        pytest.skip("no AMX tiles on this CPU or in this build")
    return ops


@pytest.mark.parametrize("rows", [1, 7, 16, 17, 40, 64])
def test_amx_linear_against_float64(ops, rows) -> None:  # noqa: ANN001
    """Every row as alone (bit for bit), within float32 sums and one bf16 rounding of the
    float64 product; the bias added before the rounding."""
    amx_or_skip(ops)
    weight = torch.randn(96, 608).to(torch.bfloat16)  # 3 output pairs, 19 K slices
    bias = torch.randn(96).to(torch.bfloat16)
    x = torch.randn(rows, 608).to(torch.bfloat16)
    packed = ops.amx_pack_weight(weight)
    out = ops.amx_linear(x, packed, bias)
    exact = x.double() @ weight.double().T + bias.double()
    scale = (x.double().abs() @ weight.double().abs().T) + bias.double().abs()
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    assert ((out.double() - exact).abs() <= 2**-8 * exact.abs() + 1e-5 * scale).all()
    for r in {0, rows // 2, rows - 1}:
        assert torch.equal(ops.amx_linear(x[r : r + 1], packed, bias)[0], out[r])


def test_amx_linear_without_bias_and_on_strided_rows(ops) -> None:  # noqa: ANN001
    amx_or_skip(ops)
    weight = torch.randn(64, 64).to(torch.bfloat16)
    wide = torch.randn(20, 96).to(torch.bfloat16)
    x = wide[:, :64]  # rows with a stride beyond their length
    out = ops.amx_linear(x, ops.amx_pack_weight(weight), None)
    exact = x.double() @ weight.double().T
    assert ((out.double() - exact).abs() <= 2**-8 * exact.abs() + 1e-4).all()


def test_amx_linear_refuses_what_it_cannot_take(ops) -> None:  # noqa: ANN001
    amx_or_skip(ops)
    with pytest.raises(RuntimeError, match="multiples of 32"):
        ops.amx_pack_weight(torch.randn(48, 64).to(torch.bfloat16))
    packed = ops.amx_pack_weight(torch.randn(64, 64).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="features"):
        ops.amx_linear(torch.randn(4, 32).to(torch.bfloat16), packed, None)
    with pytest.raises(RuntimeError, match="bias"):
        ops.amx_linear(
            torch.randn(4, 64).to(torch.bfloat16), packed, torch.randn(63).to(torch.bfloat16)
        )
