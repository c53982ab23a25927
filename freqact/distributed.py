"""The few DDP / FSDP2 helpers the trainer needs, for runs under `torchrun`.

`torchrun --nproc_per_node=K [--nnodes ...]` sets RANK, WORLD_SIZE and LOCAL_RANK (and the
rendezvous address) in each process's environment; `setup` reads them and joins the process group
(nccl on CUDA, gloo on the CPU). Without those variables everything degrades to one process and
every helper is a no-op, so the trainer has a single code path.

A group that `setup` creates is destroyed by `teardown` at the end of `train`. Under torchrun,
creating a second group in the same process hangs in torchrun's rendezvous store, so a script that
calls `train` several times creates the group itself once (`dist.init_process_group("gloo")`);
`train` then uses that group and leaves it alone.

`wrap` gives the module a training step calls: the model itself with one process, else
DistributedDataParallel, or with `fsdp` the model sharded in place by FSDP2 (`fully_shard` on each
block, then on the root). `full_state` / `load_full_state` move whole (unsharded) state dicts in
and out, so a checkpoint of an FSDP2 run has the same model state dict as any other.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass(frozen=True)
class Context:
    """Where this process stands in the run.

    Attributes:
        rank: global rank, 0 .. world_size - 1.
        world_size: number of processes (1 without torchrun).
        local_rank: rank on this machine; picks the CUDA device.
        device: the device this process trains on.
        owns_group: True if `setup` created the process group (so `teardown` destroys it).
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    owns_group: bool = False

    @property
    def is_main(self) -> bool:
        """Rank 0 is the only process that prints and writes files."""
        return self.rank == 0


def setup(device: str | None = None) -> Context:
    """Join the process group torchrun describes, or describe a single process.

    Args:
        device: "cpu", "cuda" or "cuda:N"; None picks CUDA when available. Under torchrun a CUDA
            device becomes `cuda:LOCAL_RANK`.

    Returns:
        The context. A process group that already exists (e.g. made by the caller) is used as is.

    Raises:
        ValueError: if `device` asks for CUDA on a machine without it.
    """
    dev = pick_device(device)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1 and not dist.is_initialized():
        return Context(device=dev)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    return Context(dist.get_rank(), dist.get_world_size(), local_rank, dev, owns)


def pick_device(device: str | None = None) -> torch.device:
    """`device` as a torch.device; None means CUDA when available, else the CPU.

    Raises:
        ValueError: if `device` is not a device name, or asks for CUDA on a machine without it,
            or for a GPU index the machine does not have ("cuda:3" with two GPUs).
    """
    name = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected 'cpu', 'cuda' or 'cuda:N', got {name!r}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: expected 'cpu' on this machine (no CUDA available), "
                         f"got {name!r}")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device: expected 'cuda' or 'cuda:N' with N < {torch.cuda.device_count()} "
                         f"(the GPUs this machine has), got {name!r}")
    return dev


def teardown(ctx: Context) -> None:
    """Leave the process group if `setup` created it."""
    if ctx.owns_group and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor, ctx: Context) -> torch.Tensor:
    """Sum `tensor` over all processes in place and return it (unchanged with one process)."""
    if ctx.world_size > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def all_gather(obj: object, ctx: Context) -> list:
    """The list of every rank's `obj`, in rank order (`[obj]` with one process)."""
    if ctx.world_size == 1:
        return [obj]
    gathered = [None] * ctx.world_size
    dist.all_gather_object(gathered, obj)
    return gathered


def barrier(ctx: Context) -> None:
    """Wait for every process (no-op with one process)."""
    if ctx.world_size > 1:
        dist.barrier()


def wrap(net: nn.Module, ctx: Context, *, fsdp: bool = False,
         blocks: tuple[type[nn.Module], ...] = ()) -> nn.Module:
    """The module the training step calls (with one process: `net` itself, never sharded).

    Args:
        net: the model, already on `ctx.device`.
        fsdp: shard with FSDP2 instead of DDP: `fully_shard` on every submodule of a `blocks`
            type (each a unit whose weights are gathered only for its own forward and backward),
            then on `net` for the rest. `net` is changed in place (DTensor parameters), so
            build the optimizer after this call.

    Returns:
        DistributedDataParallel(net), or `net`.
    """
    if ctx.world_size == 1:
        return net
    if not fsdp:
        return nn.parallel.DistributedDataParallel(
            net, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
    for module in [m for m in net.modules() if blocks and isinstance(m, blocks)]:
        fully_shard(module, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net


def _state_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_state(net: nn.Module, optimizer: torch.optim.Optimizer, ctx: Context,
               fsdp: bool) -> tuple[dict | None, dict | None]:
    """(model, optimizer) state dicts, whole, on rank 0 ((None, None) on the other ranks).

    With FSDP2 every rank must call this (the shards are gathered); the model dict then has the
    plain names and tensors (on the CPU) of `net.state_dict()` without sharding, and the optimizer
    dict is keyed by parameter names (`torch.distributed.checkpoint.state_dict`'s full form).
    """
    if fsdp and ctx.world_size > 1:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model, optim = get_state_dict(net, optimizer, options=_state_options())
        return (model, optim) if ctx.is_main else (None, None)
    if not ctx.is_main:
        return None, None
    return net.state_dict(), optimizer.state_dict()


def load_full_state(net: nn.Module, optimizer: torch.optim.Optimizer, model: dict, optim: dict,
                    ctx: Context, fsdp: bool) -> None:
    """Load whole state dicts written by `full_state` (every rank reads the same checkpoint)."""
    if fsdp and ctx.world_size > 1:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(net, optimizer, model_state_dict=model, optim_state_dict=optim,
                       options=_state_options())
        return
    net.load_state_dict(model)
    optimizer.load_state_dict(optim)
