"""A trainer's weight-update group made the way RL frameworks make theirs: their helpers
are copies of torch's `init_process_group` that build a named group outside the global one.

- AReaL: areal/engine/core/distributed.py `init_custom_process_group(backend,
  init_method="tcp://host:port", rank=0, world_size, group_name, timeout)`, called from
  areal/engine/fsdp_engine.py `_init_weight_update_from_distributed` (group
  "update_weight_group"); the helper passes `group_desc=group_name` too.
- PipelineRL (finetune_loop.py before it moved to vLLM's StatelessProcessGroup):
  pipelinerl/torch_utils.py `init_extra_process_group(group_name="actor", backend="nccl",
  init_method, rank=0, world_size)`; on NCCL it passes options with
  `is_high_priority_stream = False`.

Both: a tcp:// rendezvous (the rank-0 caller hosts the TCPStore), the store prefixed with
the group name, torch's `_new_process_group_helper` under that name, then the group's
ranks registered as the identity so `dist.broadcast(t, src=0, group=g)` works. The tests
run them on CPU, so with gloo where the frameworks pass "nccl" on GPUs."""

from __future__ import annotations

import datetime

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def helper_group(
    init_method: str,
    world_size: int,
    group_name: str,
    backend: str = "gloo",
    rank: int = 0,
    timeout_s: float = 60.0,
    group_desc: str | None = None,
) -> dist.ProcessGroup:
    """This process's rank of a group named `group_name`, made through torch's helper as the
    frameworks' copies do. Blocks until every rank has joined."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size,
                                                   timeout=timeout))  # fmt: skip
    store.set_timeout(timeout)
    options = None
    if backend == "nccl":  # PipelineRL's options; AReaL passes none (the same keys)
        options = dist.ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
    group, _ = c10d._new_process_group_helper(
        world_size, rank, [], c10d.Backend(backend), c10d.PrefixStore(group_name, store),
        group_name=group_name, backend_options=options, timeout=timeout,
        group_desc=group_desc,
    )  # fmt: skip
    c10d._world.pg_group_ranks[group] = {r: r for r in range(world_size)}
    return group


def areal_group(
    master_address: str, master_port: int, world_size: int, group_name: str
) -> dist.ProcessGroup:
    """Rank 0 as AReaL's FSDP engine makes it (an IPv6 host in brackets in the URL)."""
    host = f"[{master_address}]" if ":" in master_address else master_address
    return helper_group(f"tcp://{host}:{master_port}", world_size, group_name,
                        group_desc=group_name)  # fmt: skip


def pipelinerl_group(init_method: str, world_size: int) -> dist.ProcessGroup:
    """Rank 0 as PipelineRL's trainer made it with init_extra_process_group."""
    return helper_group(init_method, world_size, "actor")
