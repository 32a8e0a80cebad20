"""An expert-parallel rank's routed experts with an adapter (hotswap/lora/experts.py's
ExpertLoRA inside model/moe.py's FusedExperts), against the definition in plain torch:
the rank holds experts 4-7 of 8 and keeps the whole adapter's A and B of those only;
rows of the adapter take W[e] + B_e A_e, base rows W[e], other ranks' experts nothing.
Two steps of the same size with their adapter rows elsewhere each get their own rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hotswap.lora.experts import ExpertLoRA
from hotswap.lora.layers import LoRABatch, LoRAContext, Segment
from hotswap.model.moe import FusedExperts, route

EXPERTS, HELD, HIDDEN, INTER, RANK, ROWS = 8, range(4, 8), 16, 8, 2, 6


def definition(up: torch.Tensor, down: torch.Tensor, adapter: dict, x: torch.Tensor,
               ids: torch.Tensor, weights: torch.Tensor, rows: range) -> torch.Tensor:  # fmt: skip
    """Every expert's weights whole ([experts, out, in]); pairs of experts outside HELD
    add nothing; `rows` take the adapter (A [experts, r, in], B [experts, out, r])."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            if e not in HELD:
                continue
            w_up, w_down = up[e], down[e]
            if t in rows:
                a, b = adapter["gate_up_proj"]
                w_up = w_up + b[e] @ a[e]
                a, b = adapter["down_proj"]
                w_down = w_down + b[e] @ a[e]
            gate, linear = (w_up @ x[t]).chunk(2)
            out[t] += weights[t, j] * (w_down @ (F.silu(gate) * linear))
    return out


def test_a_rank_adds_its_experts_part_of_the_adapter_to_each_adapter_row() -> None:
    gen = torch.Generator().manual_seed(0)
    up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.3
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.3
    adapter = {p: (torch.randn(EXPERTS, RANK, w.shape[2], generator=gen) * 0.3,
                   torch.randn(EXPERTS, w.shape[1], RANK, generator=gen) * 0.3)
               for p, w in (("gate_up_proj", up), ("down_proj", down))}  # fmt: skip
    experts = FusedExperts(len(HELD), HIDDEN, INTER, torch.float32, invariant=False)
    with torch.no_grad():
        experts.gate_up_proj.copy_(up[HELD.start : HELD.stop])
        experts.down_proj.copy_(down[HELD.start : HELD.stop])
    context = LoRAContext()
    experts.lora = ExpertLoRA(experts, 2, 4, context, HELD)
    experts.lora.write_slot(1, adapter)  # whole: the rank keeps experts 4-7
    x = torch.randn(ROWS, HIDDEN, generator=gen)
    weights, ids = route(torch.randn(ROWS, EXPERTS, generator=gen), 2, normalise=True)
    assert (ids >= HELD.start).any() and (ids < HELD.start).any()
    local = torch.where(ids >= HELD.start, ids - HELD.start, -1)
    for rows in (range(0, 3), range(3, ROWS)):  # same size, the adapter's rows elsewhere
        context.batch = LoRABatch([Segment(1, rows.start, rows.stop, RANK)], False)
        with torch.no_grad():
            got = experts(x, local, weights)
        want = definition(up, down, adapter, x, ids, weights, rows)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    base = definition(up, down, adapter, x, ids, weights, range(0))
    assert (want - base)[3:].abs().max() > 1e-2  # the adapter matters
