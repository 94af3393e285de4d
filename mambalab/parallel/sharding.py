"""How a tensor-parallel parameter maps onto the full (TP = 1) parameter, and moving between the two.

Every parameter of a tensor-parallel module is one of:

* **sharded**: rank r holds ``full.index_select(dim, index(r))``. A column-parallel weight keeps a block of
  rows, a row-parallel weight a block of columns; Mamba-2's in_proj keeps several blocks (its share of
  z, x, B, C and dt), so the index is general, not one contiguous range.
* **replicated**: every rank holds the whole tensor (norm weights). In sequence-parallel mode each rank
  sees different tokens, so these need one more all-reduce of their gradients (see
  :func:`mambalab.parallel.grads.allreduce_replicated_grads`).
* **rank 0 only**: a row-parallel bias, held and added by TP rank 0 (other ranks have no such parameter).

A module declares its own parameters' mapping in ``shard_specs()``; :func:`shard_specs` collects them
over a model, :func:`load_full_state_dict` gives each rank its share of a TP = 1 state dict, and
:func:`gather_full` rebuilds full tensors (parameters or their gradients) from every rank's share.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from mambalab.parallel.collectives import all_gather_cat

__all__ = ["Sharded", "REPLICATED", "RANK0", "shard_specs", "load_full_state_dict", "gather_full",
           "contiguous_block", "broadcast_parameters"]

REPLICATED = "replicated"
RANK0 = "rank0"


@dataclass(frozen=True)
class Sharded:
    """Rank r holds the entries ``index(r)`` (a LongTensor of positions along ``dim`` of the full tensor)."""

    dim: int
    index: Callable[[int], torch.Tensor]


def contiguous_block(size: int, tp: int, offset: int = 0) -> Callable[[int], torch.Tensor]:
    """index(r) = offset + [r·size/tp, (r+1)·size/tp): rank r's block of ``size`` entries starting at offset."""
    share = size // tp
    return lambda r: torch.arange(offset + r * share, offset + (r + 1) * share)


def shard_specs(model: nn.Module) -> dict[str, object]:
    """{parameter name: Sharded | REPLICATED | RANK0} for every parameter; undeclared ones are replicated.

    A module's ``shard_specs()`` may name its children's parameters too (a Mamba-2 shard names
    ``conv1d.weight``); a tied parameter is listed once, under its first name."""
    specs = {name: REPLICATED for name, _ in model.named_parameters()}
    for prefix, module in model.named_modules():
        if hasattr(module, "shard_specs"):   # its own parameters or its children's ("conv1d.weight")
            for name, spec in module.shard_specs().items():
                full_name = f"{prefix}.{name}" if prefix else name
                if full_name in specs:
                    specs[full_name] = spec
    return specs


@torch.no_grad()
def load_full_state_dict(model: nn.Module, full: dict[str, torch.Tensor], tp_rank: int) -> None:
    """Copy this rank's share of a TP = 1 state dict into the TP model's parameters (in place)."""
    params = dict(model.named_parameters())
    specs = shard_specs(model)
    missing = [k for k in params if k not in full]
    if missing:
        raise KeyError(f"the full state dict lacks {missing}")
    for name, p in params.items():
        spec, src = specs[name], full[name]
        if isinstance(spec, Sharded):
            src = src.index_select(spec.dim, spec.index(tp_rank).to(src.device))
        if src.shape != p.shape:
            raise ValueError(f"{name}: the full tensor gives a shard of shape {tuple(src.shape)}, the parameter "
                             f"has {tuple(p.shape)}")
        p.copy_(src)


def gather_full(model: nn.Module, tp: int, group=None, grads: bool = False, names=None) -> dict[str, torch.Tensor]:
    """The full (TP = 1) tensors, on every rank, from every rank's share: parameters, or with ``grads``
    their gradients (zeros where a rank has none). Collective: every TP rank must call it."""
    out = {}
    specs = shard_specs(model)
    for name, p in model.named_parameters():
        if names is not None and name not in names:
            continue
        t = p.grad if grads else p.data
        t = torch.zeros_like(p) if t is None else t.detach()
        spec = specs[name]
        if isinstance(spec, Sharded) and tp > 1:
            parts = all_gather_cat(t.unsqueeze(0), 0, group)      # (tp, *shard)
            shape = list(t.shape)
            shape[spec.dim] *= tp
            full = torch.empty(shape, dtype=t.dtype, device=t.device)
            for r in range(tp):
                full.index_copy_(spec.dim, spec.index(r).to(t.device), parts[r])
            out[name] = full
        else:
            out[name] = t.clone()
    # A rank-0-only parameter exists on rank 0 alone: send it to the others (they list it too).
    rank0 = [n for n, s in specs.items() if s == RANK0]
    if tp > 1 and dist.is_initialized():
        obj = [{n: out.get(n) for n in rank0}]
        dist.broadcast_object_list(obj, src=dist.get_global_rank(group, 0) if group is not None else 0,
                                   group=group)
        out.update({n: t for n, t in obj[0].items() if t is not None})
    return out


@torch.no_grad()
def broadcast_parameters(model: nn.Module, layout) -> None:
    """Make the copies that must be equal, equal, whatever each rank's initialisation did (collective):
    replicated parameters from TP rank 0 to its TP group, and every parameter from DP rank 0 to its DP group.
    The row-parallel bias needs no broadcast: it exists on TP rank 0 only, and the all-reduce that follows it
    carries its contribution to every rank."""
    if not dist.is_initialized():
        return
    specs = shard_specs(model)
    if layout.tp > 1:
        src = dist.get_global_rank(layout.tp_group, 0)
        for name, p in model.named_parameters():
            if specs[name] == REPLICATED:
                dist.broadcast(p.data, src=src, group=layout.tp_group)
    if layout.dp > 1:
        src = dist.get_global_rank(layout.dp_group, 0)
        for p in model.parameters():
            dist.broadcast(p.data, src=src, group=layout.dp_group)
