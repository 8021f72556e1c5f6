"""Data-parallel training across processes: one process per device, launched by torchrun.

torchrun sets RANK, WORLD_SIZE, LOCAL_RANK (and the rendezvous address); `context_from_env`
joins the process group (NCCL on CUDA, gloo on the CPU) and says which device this process
drives: its LOCAL_RANK-th GPU of its machine.

On several machines (eagle3.train.launch, `train.nnodes`) the training rank is not torchrun's
RANK: the c10d rendezvous numbers the machines by sorting their host names and process ids
(torchrun ignores `--node-rank` with it), so RANK 0 could land on any machine. The launcher gives
each machine its node rank in EAGLE3_NODE_RANK (0: the machine that runs the train stage), and
the training rank is node rank x ranks per machine + LOCAL_RANK: training rank 0, the one that
writes checkpoints and logs, is on node 0. The process group keeps torchrun's numbering; only
the dealing of micro-batches and the choice of writer follow the training rank, and sums do
not depend on either. A step's `train.grad_accum` micro-batches are dealt round-robin to the processes:
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
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist


NODE_RANK_ENV = "EAGLE3_NODE_RANK"  # set by eagle3.train.launch on every machine's torchrun


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
    node = os.environ.get(NODE_RANK_ENV)
    if node is None:
        return DistContext(rank=rank, world_size=world, local_rank=local)
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    ctx = DistContext(rank=int(node) * per_node + local, world_size=world, local_rank=local)
    _check_training_ranks(ctx, int(node))
    return ctx


def leave() -> None:
    """Destroy the process group (if joined) before the interpreter exits.

    A process that exits with its gloo group alive can abort after its work is done, while the
    interpreter finalizes ("terminate called without an active exception", SIGABRT; see
    pytorch/pytorch#190489): its rank then fails and any output it had not flushed is lost.
    """
    if dist.is_initialized():
        dist.destroy_process_group()


def _check_training_ranks(ctx: DistContext, node: int) -> None:
    """Every training rank 0..world-1 is taken exactly once (each machine was given its own node rank)."""
    taken = torch.zeros(ctx.world_size + 1, dtype=torch.int64, device=device_for(ctx))  # [world, out of range]
    taken[ctx.rank if 0 <= ctx.rank < ctx.world_size else ctx.world_size] = 1
    dist.all_reduce(taken, op=dist.ReduceOp.SUM)
    if taken[: ctx.world_size].ne(1).any() or taken[-1]:
        raise DistError(f"the machines' node ranks do not make ranks 0..{ctx.world_size - 1} once each (this machine "
                        f"is node {node}; ranks taken: {taken[:-1].tolist()}): each `eagle3 train-node` needs its own "
                        "--node-rank, 1 .. train.nnodes-1 (node 0 is the train stage's machine)")


def spread(value: int, ctx: DistContext) -> tuple[int, int]:
    """(smallest, largest) `value` over the processes: equal when every process holds the same."""
    if not ctx.distributed:
        return value, value
    both = torch.tensor([value, -value], dtype=torch.int64, device=device_for(ctx))
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return -int(both[1]), int(both[0])


def device_for(ctx: DistContext) -> torch.device:
    """This process's device: its local GPU under CUDA (one process: the current one, which train.devices sets,
    eagle3.gpu.devices.trainer_on_gpu), else the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", ctx.local_rank if ctx.distributed else torch.cuda.current_device())


def check_grad_accum(grad_accum: int, ctx: DistContext) -> None:
    if grad_accum % ctx.world_size:
        raise DistError(
            f"train.grad_accum is {grad_accum}, which does not split over {ctx.world_size} processes (train.nnodes x "
            f"train.num_processes); set "
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


def check_rdzv_endpoint(endpoint: str | None, nnodes: int) -> None:
    """train.rdzv_endpoint: 'host:port' (an IPv6 host in brackets), required when several machines train."""
    expected = ("'host:port': a name or IP of node 0 (the machine that runs the train stage) that the other machines "
                "reach, and a free TCP port there, e.g. 'node0.cluster:29400'")
    if endpoint is None:
        raise ValueError(f"train.rdzv_endpoint is not set, but train.nnodes={nnodes} needs the rendezvous address as "
                         f"{expected}")
    found = re.fullmatch(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})", endpoint)
    if found is None or not 0 < int(found.group(2)) < 65536:
        raise ValueError(f"train.rdzv_endpoint is {endpoint!r}; expected {expected}")
