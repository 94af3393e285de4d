"""Worker program the context-parallel tests launch with torchrun: ``torchrun … cp_workers.py NAMES OUT [BACKEND]``.

NAMES is a comma-separated list of the checks below. Every rank runs its pieces; rank 0 gathers them, compares
the whole against the single-process op and writes {name: what it measured} to OUT/rank0.json.

* ``ssd``: :func:`context_parallel_ssd` against :func:`mambalab.ops.ssd_chunk_scan`, out, the final state and
  every gradient, in both reductions, for each split of :func:`splits`.
* ``conv``: :func:`context_parallel_conv1d` against :func:`mambalab.ops.conv1d.causal_conv1d_fn`, likewise.
* ``partial_grad``: the CP = 4 edge split without autograd (torch.no_grad()), and with only the last rank's x
  requiring grad (every rank must still run the backward's ring): out and the last piece's dx.
* ``errors``: the messages every rank raises for a piece too short for the halo, for heads that disagree, and
  for packed sequences whose indices decrease at a cut (the SSD and the conv).

The splits of the l = 64 positions (chunk_size 16): with 4 ranks, pieces of 16 (cuts on chunk edges) and of
8, 24, 20, 12 (cuts inside chunks), then two groups of 2 at once, {0, 1} cut at 32 and {2, 3} cut at 24; with
2 ranks, the two cuts of 2 one after the other.
"""
import json
import os
import sys
from pathlib import Path

import mambalab  # noqa: F401  (before triton)
import torch
import torch.distributed as dist

from mambalab.ops.conv1d import causal_conv1d_fn
from mambalab.ops.ssd import ssd_chunk_scan
from mambalab.parallel import context_parallel_conv1d, context_parallel_ssd, sum_over_ranks
from mambalab.parallel.layout import import_group_capturing_modules

L, CHUNK = 64, 16
SSD = dict(b=2, h=2, p=4, g=1, n=4)
CONV = dict(b=2, d=4, width=4)
PIECES = {"cp4/edges": [16, 16, 16, 16], "cp4/inside": [8, 24, 20, 12], "cp2/edges": [32, 32],
          "cp2/inside": [24, 40]}


def splits(world: int) -> list[list[tuple[str, list[int]]]]:
    """Rounds of (split, its ranks); the splits of one round run at once on disjoint groups."""
    if world == 4:
        return [[("cp4/edges", [0, 1, 2, 3])], [("cp4/inside", [0, 1, 2, 3])],
                [("cp2/edges", [0, 1]), ("cp2/inside", [2, 3])]]
    if world == 2:
        return [[("cp2/edges", [0, 1])], [("cp2/inside", [0, 1])]]
    raise ValueError(f"cp_workers runs on 2 or 4 ranks; got {world}")


def _compare(got: dict, want: dict) -> dict:
    return {k: {"bitwise": bool(torch.equal(got[k], want[k])), "max_diff": (got[k] - want[k]).abs().max().item(),
                "scale": want[k].abs().max().item()} for k in want}


def _run_splits(device, groups, fn) -> dict:
    """For every split this rank takes part in: fn(piece start, piece end, group, is_last) -> dict of tensors.
    Returns {split: (rank in the split, that dict)} with the tensors on the CPU."""
    mine = {}
    for rnd in splits(dist.get_world_size()):
        for name, ranks in rnd:
            if dist.get_rank() not in ranks:
                continue
            r = ranks.index(dist.get_rank())
            bounds = [0]
            for length in PIECES[name]:
                bounds.append(bounds[-1] + length)
            got = fn(bounds[r], bounds[r + 1], groups[name], r == len(ranks) - 1)
            mine[name] = (r, {k: v.detach().cpu() for k, v in got.items()})
        dist.barrier()
    return mine


def _assemble(gathered: list[dict], name: str, along: dict, summed: tuple, last_only: tuple) -> dict:
    """Rank 0: the split's pieces joined along their sequence dims (``along``: key -> dim), the rank sums (already
    added over the group: taken from the split's rank 0) and what only the last rank holds."""
    pieces = sorted((piece for rank in gathered if name in rank for piece in [rank[name]]), key=lambda rp: rp[0])
    whole = {k: torch.cat([p[1][k] for p in pieces], dim=dim) for k, dim in along.items()}
    whole.update({k: pieces[0][1][k] for k in summed})
    whole.update({k: pieces[-1][1][k] for k in last_only})
    return whole


def ssd(device, groups, out: dict) -> None:
    b, h, p, g, n = SSD["b"], SSD["h"], SSD["p"], SSD["g"], SSD["n"]
    gen = torch.Generator().manual_seed(0)
    full = dict(x=torch.randn(b, L, h, p, generator=gen), dt=torch.randn(b, L, h, generator=gen) - 1.0,
                B=torch.randn(b, L, g, n, generator=gen), C=torch.randn(b, L, g, n, generator=gen),
                z=torch.randn(b, L, h, p, generator=gen))
    params = dict(A=-torch.rand(h, generator=gen) - 0.5, D=torch.randn(h, generator=gen),
                  dt_bias=torch.randn(h, generator=gen) * 0.1)
    w_out, w_final = torch.randn(b, L, h, p, generator=gen), torch.randn(b, h, p, n, generator=gen)
    full = {k: v.to(device) for k, v in full.items()}
    params = {k: v.to(device) for k, v in params.items()}
    w_out, w_final = w_out.to(device), w_final.to(device)
    seq = ("x", "dt", "B", "C", "z")
    kw = dict(dt_softplus=True, return_final_states=True)

    for reduction in ("deterministic", "atomic"):
        def piece(start, end, group, last):
            ins = {k: full[k][:, start:end].clone().requires_grad_() for k in seq}
            ps = {k: v.clone().requires_grad_() for k, v in params.items()}
            y, final = context_parallel_ssd(ins["x"], ins["dt"], ps["A"], ins["B"], ins["C"], CHUNK, D=ps["D"],
                                            z=ins["z"], dt_bias=ps["dt_bias"], group=group, reduction=reduction,
                                            **kw)
            loss = (y * w_out[:, start:end]).sum() + ((final * w_final).sum() if last else 0.0)
            loss.backward()
            return {"out": y, "final": final, **{f"d{k}": v.grad for k, v in ins.items()},
                    **{f"d{k}": sum_over_ranks(v.grad, group) for k, v in ps.items()}}

        mine = _run_splits(device, groups, piece)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        if dist.get_rank() != 0:
            continue
        ins = {k: v.clone().requires_grad_() for k, v in full.items()}
        ps = {k: v.clone().requires_grad_() for k, v in params.items()}
        y, final = ssd_chunk_scan(ins["x"], ins["dt"], ps["A"], ins["B"], ins["C"], CHUNK, D=ps["D"], z=ins["z"],
                                  dt_bias=ps["dt_bias"], reduction=reduction, **kw)
        ((y * w_out).sum() + (final * w_final).sum()).backward()
        want = {"out": y.detach(), "final": final.detach(), **{f"d{k}": v.grad for k, v in {**ins, **ps}.items()}}
        want = {k: v.cpu() for k, v in want.items()}
        along = {"out": 1, **{f"d{k}": 1 for k in seq}}
        for name in PIECES:
            if any(name in rank for rank in gathered):
                got = _assemble(gathered, name, along, ("dA", "dD", "ddt_bias"), ("final",))
                out[f"{reduction}/{name}"] = _compare(got, want)


def partial_grad(device, groups, out: dict) -> None:
    b, h, p, g, n = SSD["b"], SSD["h"], SSD["p"], SSD["g"], SSD["n"]
    gen = torch.Generator().manual_seed(2)
    x, dt = torch.randn(b, L, h, p, generator=gen).to(device), torch.randn(b, L, h, generator=gen).to(device)
    A = (-torch.rand(h, generator=gen) - 0.5).to(device)
    B, C = (torch.randn(b, L, g, n, generator=gen).to(device) for _ in range(2))
    w_out = torch.randn(b, L, h, p, generator=gen).to(device)
    r, world = dist.get_rank(), dist.get_world_size()
    piece = slice(r * L // world, (r + 1) * L // world)   # cuts on chunk edges (16 positions with 4 ranks)
    with torch.no_grad():
        y = context_parallel_ssd(x[:, piece], dt[:, piece], A, B[:, piece], C[:, piece], CHUNK)
    xs = x[:, piece].clone().requires_grad_(r == world - 1)
    y_grad = context_parallel_ssd(xs, dt[:, piece], A, B[:, piece], C[:, piece], CHUNK)
    (y_grad * w_out[:, piece]).sum().backward()   # on ranks whose inputs need no grad too: the ring's backward
    gathered = [None] * world
    dist.all_gather_object(gathered, {"out": y.cpu(), "out_grad_mode": y_grad.detach().cpu(),
                                      "dx": xs.grad.cpu() if xs.grad is not None else None})
    if r != 0:
        return
    xs = x.clone().requires_grad_()
    want = ssd_chunk_scan(xs, dt, A, B, C, CHUNK)
    (want * w_out).sum().backward()
    out["no_grad_out"] = torch.equal(torch.cat([g["out"] for g in gathered], dim=1), want.detach().cpu())
    out["grad_out"] = torch.equal(torch.cat([g["out_grad_mode"] for g in gathered], dim=1), want.detach().cpu())
    out["dx_last"] = torch.equal(gathered[-1]["dx"], xs.grad[:, (world - 1) * L // world:].cpu())
    out["dx_others_none"] = all(g["dx"] is None for g in gathered[:-1])


def conv(device, groups, out: dict) -> None:
    b, d, width = CONV["b"], CONV["d"], CONV["width"]
    gen = torch.Generator().manual_seed(1)
    x, w_out = torch.randn(b, d, L, generator=gen).to(device), torch.randn(b, d, L, generator=gen).to(device)
    weight, bias = torch.randn(d, width, generator=gen).to(device), torch.randn(d, generator=gen).to(device)

    def piece(start, end, group, last):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x[..., start:end], weight, bias))
        y = context_parallel_conv1d(xs, ws, bs, activation="silu", group=group)
        (y * w_out[..., start:end]).sum().backward()
        return {"out": y, "dx": xs.grad, "dweight": sum_over_ranks(ws.grad, group),
                "dbias": sum_over_ranks(bs.grad, group)}

    mine = _run_splits(device, groups, piece)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if dist.get_rank() != 0:
        return
    xs, ws, bs = (t.clone().requires_grad_() for t in (x, weight, bias))
    y = causal_conv1d_fn(xs, ws, bs, activation="silu")
    (y * w_out).sum().backward()
    want = {k: v.detach().cpu() for k, v in {"out": y, "dx": xs.grad, "dweight": ws.grad, "dbias": bs.grad}.items()}
    for name in PIECES:
        if any(name in rank for rank in gathered):
            out[name] = _compare(_assemble(gathered, name, {"out": 2, "dx": 2}, ("dweight", "dbias"), ()), want)


def _message(fn) -> str:
    try:
        fn()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


def errors(device, groups, out: dict) -> None:
    r, world = dist.get_rank(), dist.get_world_size()
    short = 2 if r == world - 1 else 8   # the last piece is shorter than width - 1 = 3
    x, weight = torch.randn(1, 4, short, device=device), torch.randn(4, 4, device=device)
    conv_short = _message(lambda: context_parallel_conv1d(x, weight))
    h = 3 if r == 1 else 2               # rank 1 has a head more than the others
    b, l, p, n = 1, 16, 4, 4
    heads = _message(lambda: context_parallel_ssd(torch.randn(b, l, h, p, device=device),
                                                  torch.randn(b, l, h, device=device), -torch.ones(h, device=device),
                                                  torch.randn(b, l, 1, n, device=device),
                                                  torch.randn(b, l, 1, n, device=device), CHUNK))
    # packed sequences numbered 0 on ranks 0 and 1, then 1 on rank 2, then 0 again on rank 3: a decrease at a cut
    seq_idx = torch.full((b, l), 1 if r == 2 else 0, dtype=torch.int32, device=device)
    ssd_in = (torch.randn(b, l, 2, p, device=device), torch.randn(b, l, 2, device=device),
              -torch.ones(2, device=device), torch.randn(b, l, 1, n, device=device),
              torch.randn(b, l, 1, n, device=device), CHUNK)
    seq_ssd = _message(lambda: context_parallel_ssd(*ssd_in, seq_idx=seq_idx))
    seq_conv1d = _message(lambda: context_parallel_conv1d(torch.randn(1, 4, l, device=device), weight, seq_idx=seq_idx))
    names = ("conv_short", "heads", "seq_ssd", "seq_conv1d")
    gathered = [None] * world
    dist.all_gather_object(gathered, dict(zip(names, (conv_short, heads, seq_ssd, seq_conv1d))))
    out.update({k: [g[k] for g in gathered] for k in names})


if __name__ == "__main__":
    names, out_dir = sys.argv[1], Path(sys.argv[2])
    backend = sys.argv[3] if len(sys.argv) > 3 else "gloo"
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    import_group_capturing_modules()
    dist.init_process_group(backend)
    device = torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")
    world = dist.get_world_size()
    groups = {}
    for rnd in splits(world):   # every rank creates every group, in the same order
        for name, ranks in rnd:
            groups[name] = dist.new_group(ranks) if len(ranks) < world else None
    result = {}
    for part in names.split(","):
        result[part] = {}
        {"ssd": ssd, "conv": conv, "partial_grad": partial_grad, "errors": errors}[part](device, groups, result[part])
    if dist.get_rank() == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "rank0.json").write_text(json.dumps(result))
    dist.barrier()   # every rank done before any tears down: rank 0 also hosts the rendezvous store
    dist.destroy_process_group()
