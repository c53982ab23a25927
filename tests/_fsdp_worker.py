"""Run under `torchrun --nproc_per_node=2` by tests/test_fsdp.py: FSDP2 models inside `compress`.

Each case trains a small Conv/ReLU/Linear model sharded with `fully_shard` for two SGD steps on
rank-local halves of one global batch and records its full (gathered) gradients; rank 0 also
computes the single-process references. Everything goes to one file, `sys.argv[1]`, that the tests
read (torch.save of tensors, numbers and strings only).
"""
from __future__ import annotations

import contextlib
import copy
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

import freqact

BATCH = 4  # per rank
LR = 0.05


class Block(nn.Module):
    def __init__(self, ckpt: bool) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(),
                                  nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())
        self.ckpt = ckpt

    def forward(self, x):
        return checkpoint(self.body, x, use_reentrant=False) if self.ckpt else self.body(x)


class Net(nn.Module):
    def __init__(self, ckpt: bool = False) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.blocks = nn.Sequential(Block(ckpt), Block(ckpt))
        self.head = nn.Linear(4 * 8 * 8, 10)

    def forward(self, x):
        return self.head(self.blocks(torch.relu(self.stem(x))).flatten(1))


def _batch():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(2 * BATCH, 3, 8, 8, generator=gen), torch.randint(0, 10, (2 * BATCH,),
                                                                         generator=gen)


def _shard(net: Net, mesh, *, reshard: bool, root: bool, mp=None) -> None:
    """fully_shard each block (then the root, unless the stem and head stay plain)."""
    kwargs = {"mesh": mesh, "reshard_after_forward": reshard}
    if mp is not None:
        kwargs["mp_policy"] = mp
    for block in net.blocks:
        fully_shard(block, **kwargs)
    if root:
        fully_shard(net, **kwargs)


def _full_grads(net: nn.Module) -> dict:
    """Every gradient, whole: DTensor shards gathered, plain ones (already equal) averaged again."""
    out = {}
    for name, p in net.named_parameters():
        if p.grad is None:  # frozen
            continue
        if isinstance(p.grad, DTensor):
            out[name] = p.grad.full_tensor()
        else:
            g = p.grad.clone()
            dist.all_reduce(g)
            out[name] = g / dist.get_world_size()
    return out


def _steps(net, x, y, mode, *, sync_plain: bool = False, amp: bool = False) -> tuple[list, list]:
    """Two SGD steps; returns ([full grads per step], [meter per step or None])."""
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=LR)
    grads, meters = [], []
    for _ in range(2):
        ctx = freqact.compress(net, mode) if mode else contextlib.nullcontext()
        with ctx as meter, torch.autocast("cpu", torch.bfloat16, enabled=amp):
            loss = _loss(net, x, y)
        opt.zero_grad()
        loss.backward()
        if sync_plain:  # parameters outside every FSDP2 unit: averaged by hand, as DDP would
            for p in net.parameters():
                if not isinstance(p, DTensor) and p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= dist.get_world_size()
        grads.append(_full_grads(net))
        meters.append(_meter(meter) if mode else None)
        opt.step()
    return grads, meters


def _loss(net, x, y):
    return nn.functional.cross_entropy(net(x).float(), y)


def _meter(meter) -> dict:
    return {"saved": meter.saved_bytes, "exact": meter.exact_bytes,
            "rows": [(r.layer, r.routes, r.saved_bytes, r.exact_bytes, r.count)
                     for r in meter.per_layer()]}


def _reference(base: Net, x, y) -> list:
    """One process, the same global batch as the ranks' halves: gradients accumulated, halved."""
    net = copy.deepcopy(base)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    grads = []
    for _ in range(2):
        opt.zero_grad()
        for half in range(2):
            sl = slice(half * BATCH, (half + 1) * BATCH)
            nn.functional.cross_entropy(net(x[sl]), y[sl]).backward()
        for p in net.parameters():
            p.grad /= 2
        grads.append({n: p.grad.clone() for n, p in net.named_parameters()})
        opt.step()
    return grads


def _whole(base: Net, x, y) -> dict:
    """One process, one backward over the whole global batch (first step's gradients)."""
    net = copy.deepcopy(base)
    nn.functional.cross_entropy(net(x), y).backward()
    return {n: p.grad.clone() for n, p in net.named_parameters()}


def _local_meter(base: Net, x, y, mode, dtype=torch.float32, amp=False) -> dict:
    """The meter of one process on this rank's batch (no sharding)."""
    net = copy.deepcopy(base).to(dtype)
    with freqact.compress(net, mode) as meter, torch.autocast("cpu", torch.bfloat16, enabled=amp):
        _loss(net, x.to(dtype), y)
    return _meter(meter)


def _tensor_parallel_refused(mesh) -> str:
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    lin = parallelize_module(nn.Sequential(nn.Linear(4, 4)), mesh, {"0": ColwiseParallel()})
    try:
        with freqact.compress(lin, "exact"):
            pass
    except ValueError as err:
        return str(err)
    return "no error"


def _resnet(rank: int) -> dict:
    """`freqact train --fsdp`'s sharding (distributed.wrap) of resnet20: units, exact gradients
    (BatchNorm reads each rank's half, as the reference's halves), division meter."""
    from freqact import distributed, models

    torch.manual_seed(0)
    base = models.get("resnet20")
    net = copy.deepcopy(base)
    ctx = distributed.Context(rank=rank, world_size=dist.get_world_size())
    distributed.wrap(net, ctx, fsdp=True, blocks=models.BLOCK_TYPES)
    gen = torch.Generator().manual_seed(2)
    gx, gy = torch.randn(4, 3, 32, 32, generator=gen), torch.randint(0, 10, (4,), generator=gen)
    x, y = gx[2 * rank:2 * rank + 2], gy[2 * rank:2 * rank + 2]
    with freqact.compress(net, "exact"):
        loss = _loss(net, x, y)
    loss.backward()
    grads = _full_grads(net)
    with freqact.compress(net, "division") as meter:
        _loss(net, x, y)
    units = [name for name, m in net.named_modules() if isinstance(m, FSDPModule)]
    out = {"units": units, "grads": grads, "meter": _meter(meter),
           "local": _local_meter(base, x, y, "division")}
    if rank == 0:
        ref = copy.deepcopy(base)
        for half in range(2):
            _loss(ref, gx[2 * half:2 * half + 2], gy[2 * half:2 * half + 2]).backward()
        out["reference"] = {n: p.grad / 2 for n, p in ref.named_parameters()}
        out["blocks"] = [n for n, m in base.named_modules() if isinstance(m, models.BLOCK_TYPES)]
    return out


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    base, base_ckpt = Net(), Net(ckpt=True)
    base_ckpt.load_state_dict(base.state_dict())
    gx, gy = _batch()
    x, y = gx[rank * BATCH:(rank + 1) * BATCH], gy[rank * BATCH:(rank + 1) * BATCH]
    results = {}

    def run(name, model, mode, *, reshard=True, root=True, mp=None, amp=False):
        net = copy.deepcopy(model)
        _shard(net, mesh, reshard=reshard, root=root, mp=mp)
        torch.manual_seed(10 + rank)  # codec noise
        results[name] = _steps(net, x, y, mode, sync_plain=not root, amp=amp)

    run("exact-reshard", base, "exact", reshard=True)
    run("exact-keep", base, "exact", reshard=False)
    run("exact-mixed", base, "exact", root=False)
    run("exact-ckpt", base_ckpt, "exact")
    run("division-ckpt", base_ckpt, "division")
    run("division", base, "division")
    run("plain", base, None)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    run("exact-bf16", base, "exact", mp=bf16)
    run("plain-bf16", base, None, mp=bf16)
    frozen = copy.deepcopy(base)
    frozen.stem.requires_grad_(False)  # a frozen weight's autocast copy has no history
    run("exact-autocast", frozen, "exact", amp=True)
    run("plain-autocast", frozen, None, amp=True)
    local = {"division": _local_meter(base, x, y, "division"),
             "exact-bf16": _local_meter(base, x, y, "exact", torch.bfloat16),
             "exact-autocast": _local_meter(frozen, x, y, "exact", amp=True)}
    results["local-meters"] = [None] * dist.get_world_size()
    dist.all_gather_object(results["local-meters"], local)
    for name in local:
        meters = [None] * dist.get_world_size()
        dist.all_gather_object(meters, results[name][1])
        results[name + "-meters"] = meters
    results["tensor-parallel"] = _tensor_parallel_refused(mesh)
    resnet = _resnet(rank)
    results["resnet-meters"] = [None] * dist.get_world_size()
    dist.all_gather_object(results["resnet-meters"], (resnet.pop("meter"), resnet.pop("local")))
    results["resnet"] = resnet
    if rank == 0:
        results["reference"] = _reference(base, gx, gy)
        results["whole"] = _whole(base, gx, gy)
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
