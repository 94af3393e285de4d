"""Worker program the context-parallel block test launches: ``torchrun --nproc_per_node 4 cp_block_worker.py OUT``.

TP = 2 × CP = 2 (:func:`mambalab.parallel.init_distributed`): each rank builds the whole single-process
:class:`~mambalab.modules.mamba2.Mamba2` block from one seed, keeps its TP share in a
:class:`~mambalab.parallel.ContextParallelMamba2` and runs its half of the sequence, with packed sequences.
The gradients are summed over CP (:func:`~mambalab.parallel.context_mamba2.sum_context_parallel_grads`)
and gathered over TP; rank 0 runs the single-process block on the whole sequence and writes, for the output,
d u and every parameter's gradient, {"bitwise", "max_diff", "scale"} to OUT/block.json. (Sequences without
seq_idx take the same path but for the masks: the training tests run them, and test_context_parallel.py the
ring's ops.)

The packed sequences (l = 64, the cut at 32, chunk 16): in row 0 a sequence runs from 20 to 45, across the cut;
in row 1 a sequence starts exactly at the cut (32) and another at 50.
"""
import json
import sys
from pathlib import Path

import mambalab  # noqa: F401  (before triton)
import torch
import torch.distributed as dist

from mambalab.modules.mamba2 import Mamba2
from mambalab.parallel import ContextParallelMamba2, init_distributed, load_full_state_dict
from mambalab.parallel.context_mamba2 import sum_context_parallel_grads
from mambalab.parallel.sharding import gather_full

B, L, D_MODEL = 2, 64, 16
BLOCK = dict(d_state=8, headdim=8, ngroups=2, chunk_size=16)   # 4 heads, 2 groups: each TP rank takes 2 and 1


def packed_seq_idx() -> torch.Tensor:
    seq = torch.zeros(B, L, dtype=torch.int32)
    seq[0, 20:], seq[0, 45:] = 1, 2
    seq[1, 10:], seq[1, 32:], seq[1, 50:] = 1, 2, 3
    return seq


def _compare(got: torch.Tensor, want: torch.Tensor) -> dict:
    return {"bitwise": bool(torch.equal(got, want)), "max_diff": (got - want).abs().max().item(),
            "scale": want.abs().max().item()}


def main() -> None:
    out_dir = Path(sys.argv[1])
    layout = init_distributed(tp=2, cp=2, timeout_s=60)
    torch.manual_seed(0)
    full = Mamba2(D_MODEL, **BLOCK)                                      # the same on every rank
    gen = torch.Generator().manual_seed(1)
    u, w = torch.randn(B, L, D_MODEL, generator=gen), torch.randn(B, L, D_MODEL, generator=gen)
    block = ContextParallelMamba2(D_MODEL, layout, **BLOCK)
    load_full_state_dict(block, full.state_dict(), layout.tp_rank)
    piece = L // layout.cp
    lo, hi = layout.cp_rank * piece, (layout.cp_rank + 1) * piece
    seq_idx = packed_seq_idx()
    u_k = u[:, lo:hi].clone().requires_grad_()
    y = block(u_k, seq_idx=seq_idx[:, lo:hi])
    (y * w[:, lo:hi]).sum().backward()
    sum_context_parallel_grads(block, layout)
    grads = gather_full(block, layout.tp, layout.tp_group, grads=True)
    pieces = {k: [torch.empty_like(t) for _ in range(layout.cp)] for k, t in (("out", y), ("du", u_k.grad))}
    for k, t in (("out", y.detach()), ("du", u_k.grad)):
        dist.all_gather(pieces[k], t.contiguous(), group=layout.cp_group)
    if layout.rank == 0:
        u_full = u.clone().requires_grad_()
        y_full = full(u_full, seq_idx=seq_idx)
        (y_full * w).sum().backward()
        want = {"out": y_full.detach(), "du": u_full.grad, **{f"d {n}": p.grad for n, p in full.named_parameters()}}
        got = {"out": torch.cat(pieces["out"], 1), "du": torch.cat(pieces["du"], 1),
               **{f"d {n}": grads[n] for n, _ in full.named_parameters()}}
        results = {"packed": {k: _compare(got[k], want[k]) for k in want}}
        (out_dir / "block.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
