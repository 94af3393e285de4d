"""Context parallelism against one process, run as real ranks: what chapter 06 launches to check
:func:`mambalab.parallel.context.context_parallel_ssd` forward and backward.

    python -m torch.distributed.run --standalone --nproc_per_node 4 -m mambalab.parallel.context_check --out DIR

or from Python, :func:`run_rank` started once a rank (``torch.multiprocessing.start_processes``).

Every rank builds the same seeded inputs (:func:`check_inputs`), and in each round of :func:`check_runs` the
ranks of a run take its pieces of the sequence, one contiguous piece a rank in rank order, and run the SSD with
the loss Σ out ⊙ w: out, the final state and every gradient, the per-head parameters' summed over the run's
ranks (:func:`~mambalab.parallel.context.sum_over_ranks`). Each rank saves what it computed to DIR/rank{r}.pt;
:func:`gather` joins the pieces along l, and :func:`single_process` gives the same results from
:func:`mambalab.ops.ssd_chunk_scan` on the whole sequence, to compare.

gloo on the CPU (the kernels in Triton's interpreter), NCCL with one GPU a rank where CUDA is present; the
backward's reduction is "deterministic", the mode in which the bitwise claim of
:mod:`mambalab.parallel.context`'s docstring holds on a GPU.

:func:`per_position_terms` gives each position's term of dA, dD and d dt_bias in float64 (the recurrence of
:func:`mambalab.ref.ssd.ssd_step` with those parameters made per position), so Σ|term| bounds Σ|p_i| of the
partials whose order differs between the runs (the bound in :mod:`mambalab.parallel.context`'s docstring).
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

__all__ = ["CHECK_SIZES", "PER_HEAD", "PER_POSITION", "check_inputs", "check_runs", "gather", "per_position_terms",
           "run_rank", "single_process"]

PER_POSITION = ("out", "final", "dx", "ddt", "dB", "dC", "dz")   # bitwise for cuts on chunk edges
PER_HEAD = ("dA", "dD", "ddt_bias")                               # the same partials, summed in another order
_SEQUENCE, _PARAMETERS = ("x", "dt", "B", "C", "z"), ("A", "D", "dt_bias")
CHECK_SIZES = dict(b=1, l=64, h=2, p=4, g=1, n=4, chunk=16)   # tiny: on a CPU the kernels run in the interpreter


def check_inputs(b: int, l: int, h: int, p: int, g: int, n: int, chunk: int, seed: int = 0) -> dict:
    """The whole sequence's SSD inputs and the loss weight w, seeded: x, z, w (b, l, h, p); dt (b, l, h);
    B, C (b, l, g, n); A, D, dt_bias (h,). ``chunk`` is the chunk size (not used here: one sizes dict for all)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen)
    return dict(x=r(b, l, h, p), dt=r(b, l, h) - 1.0, B=r(b, l, g, n), C=r(b, l, g, n), z=r(b, l, h, p),
                A=-torch.rand(h, generator=gen) - 0.5, D=r(h), dt_bias=0.1 * r(h), w=r(b, l, h, p))


def check_runs(world: int, l: int, chunk: int) -> list[list[tuple[str, list[int], list[int]]]]:
    """Rounds of runs (name, its ranks, its pieces' lengths); the runs of a round use disjoint ranks and run at
    once. CP = ``world`` with cuts on chunk edges; CP = 2 with its cut on a chunk edge, and with it half a chunk
    later (inside a chunk); CP = 1, a group of one rank."""
    if world not in (2, 4) or l % (world * chunk) or chunk % 2:
        raise ValueError(f"the check runs on 2 or 4 ranks with l a multiple of ranks · chunk and an even chunk; got "
                         f"{world} ranks, l = {l}, chunk = {chunk}")
    half, edges = l // 2, [l // world] * world
    inside = ("CP = 2, a cut inside a chunk", [2, 3] if world == 4 else [0, 1], [half - chunk // 2, half + chunk // 2])
    rounds = [[(f"CP = {world}, cuts on chunk edges", list(range(world)), edges)]]
    if world == 4:
        rounds.append([("CP = 2, a cut on a chunk edge", [0, 1], [half, half]), inside])
    else:
        rounds.append([inside])
    return rounds + [[("CP = 1", [0], [l])]]


def _ssd(ins: dict, chunk: int, fn, **kw) -> dict:
    """out, the final state and the gradients of Σ out ⊙ w for ``fn`` (ssd_chunk_scan or context_parallel_ssd)."""
    leaves = {k: ins[k].clone().requires_grad_() for k in _SEQUENCE + _PARAMETERS}
    out, final = fn(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk, D=leaves["D"],
                    z=leaves["z"], dt_bias=leaves["dt_bias"], dt_softplus=True, return_final_states=True,
                    reduction="deterministic", **kw)
    (out * ins["w"]).sum().backward()
    return {"out": out.detach(), "final": final.detach(), **{f"d{k}": v.grad for k, v in leaves.items()}}


def single_process(sizes: dict, seed: int = 0, device="cpu") -> dict:
    """The results of :func:`mambalab.ops.ssd_chunk_scan` on the whole sequence, run on ``device``, returned on
    the CPU."""
    from mambalab.ops import ssd_chunk_scan

    ins = {k: v.to(device) for k, v in check_inputs(**sizes, seed=seed).items()}
    return {k: v.cpu() for k, v in _ssd(ins, sizes["chunk"], ssd_chunk_scan).items()}


def gather(out_dir: str | Path, world: int, runs) -> dict[str, dict]:
    """{run: its results on the whole sequence}: the ranks' pieces joined along l in rank order, the final state
    from the run's last rank, the per-head gradients (already summed over the run) from its first."""
    ranks = [torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(world)]
    joined = {}
    for rnd in runs:
        for name, members, _ in rnd:
            pieces = [ranks[r][name] for r in members]
            got = {k: torch.cat([piece[k] for piece in pieces], dim=1) for k in PER_POSITION if k != "final"}
            joined[name] = {**got, "final": pieces[-1]["final"], **{k: pieces[0][k] for k in PER_HEAD}}
    return joined


def per_position_terms(sizes: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Each position's term of dA and d dt_bias, (b, l, h), and of dD, (b, l, h, p), in float64: the loss
    Σ out ⊙ w through the recurrence (:func:`mambalab.ref.ssd.ssd_step`) with A, dt_bias and D given per position;
    summed over positions they are the gradients."""
    from mambalab.ref.ssd import ssd_step

    f64 = {k: v.double() for k, v in check_inputs(**sizes, seed=seed).items()}
    b, l, h, p = f64["x"].shape
    A = f64["A"].expand(b, l, h).clone().requires_grad_()
    bias = f64["dt_bias"].expand(b, l, h).clone().requires_grad_()
    D = f64["D"][:, None].expand(b, l, h, p).clone().requires_grad_()
    delta = F.softplus(f64["dt"] + bias)                                            # Δ (b, l, h)
    state, ys = f64["x"].new_zeros(b, h, p, f64["B"].shape[-1]), []
    for t in range(l):
        state, y_t = ssd_step(state, f64["x"][:, t], delta[:, t], A[:, t], f64["B"][:, t], f64["C"][:, t])
        ys.append(y_t)
    out = (torch.stack(ys, dim=1) + f64["x"] * D) * F.silu(f64["z"])                 # (b, l, h, p)
    (out * f64["w"]).sum().backward()
    return {"dA": A.grad, "ddt_bias": bias.grad, "dD": D.grad}


def run_rank(rank: int, world: int, init_method: str, out_dir: str, sizes: dict, seed: int = 0) -> None:
    """One rank of the check (module docstring): joins the group (NCCL on GPU ``rank`` where CUDA is present,
    gloo on the CPU otherwise), runs every run of :func:`check_runs` it takes part in, and saves
    {run: its results} to out_dir/rank{rank}.pt. ``rank`` first, so :func:`torch.multiprocessing.start_processes`
    can start it."""
    from mambalab.parallel.context import context_parallel_ssd, sum_over_ranks
    from mambalab.parallel.layout import import_group_capturing_modules

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    else:
        torch.set_num_threads(1)   # the ranks share the CPU's cores
    import_group_capturing_modules()
    dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=world)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    ins = {k: v.to(device) for k, v in check_inputs(**sizes, seed=seed).items()}
    mine = {}
    for rnd in check_runs(world, sizes["l"], sizes["chunk"]):
        groups = [dist.new_group(members) for _, members, _ in rnd]   # every rank makes every group, in order
        for (name, members, pieces), group in zip(rnd, groups):
            if rank not in members:
                continue
            i = members.index(rank)
            lo, hi = sum(pieces[:i]), sum(pieces[:i + 1])
            piece = {k: v if k in _PARAMETERS else v[:, lo:hi] for k, v in ins.items()}
            got = _ssd(piece, sizes["chunk"], context_parallel_ssd, group=group)
            got.update({k: sum_over_ranks(got[k], group) for k in PER_HEAD})   # in rank order
            mine[name] = {k: v.cpu() for k, v in got.items()}
        dist.barrier()
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    torch.save(mine, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()   # every rank done before any tears down: rank 0 hosts the rendezvous store
    dist.destroy_process_group()


def main(argv=None) -> None:
    """Under torchrun: :func:`run_rank` with the launcher's rank, world size and rendezvous."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for rank{r}.pt")
    parser.add_argument("--sizes", default=json.dumps(CHECK_SIZES), help="JSON: b, l, h, p, g, n, chunk")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), "env://", args.out, json.loads(args.sizes),
             args.seed)


if __name__ == "__main__":
    main()
