"""A mixture of experts' routed experts on the GPU without reading anything back: the
step's (token, slot) pairs are grouped by expert on the device, each expert's group padded
to whole row blocks, and one grouped-GEMM launch per projection runs every block against
its expert's weights (blocks past the last group exit at once). Shapes depend only on the
number of tokens, so a decode step with experts can be captured in a CUDA graph.

Layout as model/moe.py: gate_up_proj [experts, 2 x inter, hidden] (gate rows, then up),
down_proj [experts, hidden, inter]; each pair's expert output is rounded to the model's
dtype and the slots are weighted and summed in float32 per token, in slot order, as the
torch path does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MOE_BLOCK_M = 16  # rows (pairs) per block of one expert


@triton.jit
def grouped_gemm_kernel(
    a_ptr, w_ptr, out_ptr, pairs_ptr, block_experts_ptr, a_stride, w_expert_stride,
    w_row_stride, out_stride, num_pairs, n, k, top_k,
    GATHER: tl.constexpr, SCATTER: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """out = A @ W[expert].T for one block of rows and BLOCK_N output columns. Rows are
    padded positions in the grouped order; `pairs` holds each position's (token, slot)
    pair (num_pairs: padding). GATHER: A's row is the pair's token (else the position);
    SCATTER: the result goes to the pair's row (else the position's)."""
    block = tl.program_id(0).to(tl.int64)
    expert = tl.load(block_experts_ptr + block).to(tl.int64)
    if expert >= 0:
        positions = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(pairs_ptr + positions).to(tl.int64)
        valid = pairs < num_pairs
        a_rows = pairs // top_k if GATHER else positions
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        w_base = w_ptr + expert * w_expert_stride
        for start in range(0, k, BLOCK_K):
            ks = start + tl.arange(0, BLOCK_K)
            k_ok = ks < k
            a = tl.load(a_ptr + a_rows[:, None] * a_stride + ks[None, :],
                        mask=valid[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
            w = tl.load(w_base + cols[None, :] * w_row_stride + ks[:, None],
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
            if UPCAST:  # Triton's interpreter multiplies bf16 as its raw bits
                a, w = a.to(tl.float32), w.to(tl.float32)
            if IEEE:
                acc += tl.dot(a, w, input_precision="ieee")
            else:
                acc += tl.dot(a, w)
        out_rows = pairs if SCATTER else positions
        mask = valid[:, None] & col_ok[None, :]
        tl.store(out_ptr + out_rows[:, None] * out_stride + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)  # fmt: skip


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pairs, block_experts) for ids [tokens, top_k], by device ops only: pairs[p] is the
    (token x top_k + slot) pair at padded position p (num_pairs where p pads a group),
    block_experts[b] the expert of row block b (-1 past the last group). Sized by the
    number of pairs alone."""
    flat = ids.reshape(-1)
    num_pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + MOE_BLOCK_M - 1) // MOE_BLOCK_M * MOE_BLOCK_M
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[experts]
    groups = min(num_pairs, num_experts)  # at most this many experts are hit
    blocks = -(-(num_pairs + groups * (MOE_BLOCK_M - 1)) // MOE_BLOCK_M)
    pairs = torch.full((blocks * MOE_BLOCK_M,), num_pairs, dtype=torch.int64, device=device)
    pairs[(ends - padded)[experts] + rank] = order
    starts = torch.arange(blocks, device=device) * MOE_BLOCK_M
    block_experts = torch.searchsorted(ends, starts, right=True)
    return pairs, torch.where(block_experts >= num_experts, -1, block_experts)


def grouped_gemm(
    a: torch.Tensor, w: torch.Tensor, pairs: torch.Tensor, block_experts: torch.Tensor,
    out: torch.Tensor, num_pairs: int, top_k: int, gather: bool, scatter: bool,
    precision: dict[str, bool],
) -> None:  # fmt: skip
    n, k = w.shape[1], w.shape[2]
    block_n = max(16, min(64, triton.next_power_of_2(n)))  # tensor-core products: >= 16
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    grid = (block_experts.shape[0], triton.cdiv(n, block_n))
    grouped_gemm_kernel[grid](
        a, w, out, pairs, block_experts, a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        num_pairs, n, k, top_k, GATHER=gather, SCATTER=scatter, BLOCK_M=MOE_BLOCK_M,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, **precision,
    )  # fmt: skip
