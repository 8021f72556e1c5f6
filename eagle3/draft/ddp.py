"""Data-parallel training across processes: one process per device, launched by torchrun.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK (and the rendezvous address); `context_from_env`
joins the process group (NCCL on CUDA, gloo on the CPU) and says which device this process
drives. A step's `train.grad_accum` micro-batches are dealt round-robin to the processes:
micro-batch i of a step goes to rank i % world_size, so every process reads only its own
samples, and the step sees exactly the micro-batches a single process would. Gradients
(and the logged losses) are then summed across processes, which gives the single-process
sum of the same micro-batches: a 2-process run follows the 1-process trajectory up to
floating-point summation order.

This is DDP's arithmetic done explicitly (one flat all-reduce per optimizer step) rather
than through `DistributedDataParallel`, whose gradient hooks are armed by `forward()` and
so would not fire for the draft's `unroll`; at one draft layer the step is dominated by
its matrix products, not by the single all-reduce.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist


class DistError(RuntimeError):
    """The process-group environment or a data-parallel setting does not fit."""


@dataclass(frozen=True)
class DistContext:
    """Where this process stands in a data-parallel run (rank 0 of 1 when not launched by torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def owns(self, micro_batch: int) -> bool:
        """True when micro-batch `micro_batch` (its index within the step) is this process's."""
        return micro_batch % self.world_size == self.rank


def context_from_env() -> DistContext:
    """Read torchrun's variables and join the process group (once); single process otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistContext()
    rank, local = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local)
        dist.init_process_group(backend="nccl" if cuda else "gloo")
    if dist.get_world_size() != world or dist.get_rank() != rank:
        raise DistError(f"process group is rank {dist.get_rank()} of {dist.get_world_size()}, "
                        f"but RANK={rank} WORLD_SIZE={world}; launch with torchrun")
    return DistContext(rank=rank, world_size=world, local_rank=local)


def device_for(ctx: DistContext) -> torch.device:
    """This process's device: its local GPU under CUDA, else the CPU."""
    return torch.device("cuda", ctx.local_rank) if torch.cuda.is_available() else torch.device("cpu")


def check_grad_accum(grad_accum: int, ctx: DistContext) -> None:
    if grad_accum % ctx.world_size:
        raise DistError(
            f"train.grad_accum is {grad_accum}, which does not split over {ctx.world_size} processes; set "
            f"train.grad_accum to a multiple of {ctx.world_size} (each process takes every {ctx.world_size}th micro-batch)"
        )


def sum_gradients(params: Iterable[torch.nn.Parameter], ctx: DistContext) -> None:
    """Sum every parameter's gradient across processes, in place (one flat all-reduce)."""
    if not ctx.distributed:
        return
    params = list(params)
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])  # [total parameters]
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    offset = 0
    for param, grad in zip(params, grads, strict=True):
        size = grad.numel()
        param.grad = flat[offset : offset + size].view_as(grad)
        offset += size


def sum_values(values: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum a small tensor of values (losses) across processes; returns it (in place when distributed)."""
    if ctx.distributed:
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def barrier(ctx: DistContext) -> None:
    if ctx.distributed:
        dist.barrier()
