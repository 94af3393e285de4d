"""mambalab.ops.ssd_chunk_scan (both reduction modes) against mamba-ssm's mamba_chunk_scan_combined, on a GPU,
in one process.

At b=4, l=4096, h=32, p=64, g=1, n=128, chunk 256 (dt_softplus, D and dt_bias given, as in the measurements
in shared/measurements), in bf16 and fp32: forward and forward+backward times, distinct gradient bit patterns
over repeated backward passes, and the largest differences from mamba-ssm. mamba-ssm's deterministic mode
pins its configurations at import, so it is a separate process: run once plain and once with
``--mamba-deterministic`` (which sets MAMBA_DETERMINISTIC=1 before mamba-ssm is imported). Each process times
mambalab beside the rival it has, so every ratio is within one run.

``--varlen N``: packed sequences instead. The b · l tokens of the shape (16384 by default) as one row of N
sequences of unequal lengths (seeded cuts), ``seq_idx`` and ``cu_seqlens`` given: forward+backward of mambalab
(deterministic) against mamba_chunk_scan_combined with the same seq_idx, the forward with
``return_varlen_states`` for both (mamba-ssm's backward refuses varlen states), mambalab on the same row
without seq_idx (what the masks cost), and the largest differences from mamba-ssm. The JSON is written after
each piece; a piece that fails (the rival's, say) is recorded as {"error": ...} and the rest still run.
With ``--profile`` also where each side's forward+backward spends its device time (:func:`common.profile_table`),
and, as a diagnostic, mambalab's time with the checks that read the device back before the launch (dt finite,
seq_idx nondecreasing) skipped: what those readbacks cost.

    python benchmarks/bench_ssd.py --out DIR/ssd_default.json [--mamba-deterministic] [--stages] [--sweep]
                                  [--precompile-rival N] [--varlen N [--profile]]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import mambalab  # noqa: E402,F401
from common import (add_precompile_arguments, distinct_patterns, environment, keep_config_slice,  # noqa: E402
                    precompile_in_parallel, profile_table, time_ms, write)

NAMES = ("x", "dt", "A", "B", "C", "D", "dt_bias")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make(b, l, h, p, g, n, dtype, seed=0):
    """The measured shape's inputs: x, B, C in ``dtype``; dt in ``dtype``; A, D, dt_bias fp32."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    r = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    return {
        "x": r(b, l, h, p).to(dtype),
        "dt": (0.5 * r(b, l, h) - 1.0).to(dtype),
        "A": -torch.exp(r(h) * 0.5),
        "B": r(b, l, g, n).to(dtype),
        "C": r(b, l, g, n).to(dtype),
        "D": r(h),
        "dt_bias": 0.1 * r(h),
    }


def step(fn, x, dout, chunk, backward=True, **kw):
    leaves = {k: v.detach().requires_grad_(backward) for k, v in x.items()}
    out = fn(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], chunk, D=leaves["D"],
             dt_bias=leaves["dt_bias"], dt_softplus=True, **kw)
    if not backward:
        return out, None
    out.backward(dout)
    return out, {k: v.grad for k, v in leaves.items()}


def measure(fn, x, dout, chunk, reps, **kw):
    with torch.no_grad():
        fwd = time_ms(lambda: step(fn, x, dout, chunk, backward=False, **kw))
    fwd_bwd = time_ms(lambda: step(fn, x, dout, chunk, **kw))
    runs = [step(fn, x, dout, chunk, **kw)[1] for _ in range(reps)]
    return {"fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd, "distinct_grad_patterns": distinct_patterns(runs)}


def differences(ours, theirs):
    (o_out, o_g), (t_out, t_g) = ours, theirs
    diff = {"out": (o_out.float() - t_out.float()).abs().max().item()}
    scale = {"out": t_out.float().abs().max().item()}
    for k in NAMES:
        diff[k] = (o_g[k].float() - t_g[k].float()).abs().max().item()
        scale[k] = t_g[k].float().abs().max().item()
    return {"max_abs_diff": diff, "max_abs_rival": scale}


def varlen_lengths(total, count, seed=0):
    """``count`` unequal sequence lengths summing to ``total``: cuts at count - 1 distinct seeded positions."""
    gen = torch.Generator().manual_seed(seed)
    cuts = (torch.randperm(total - 1, generator=gen)[:count - 1] + 1).sort().values.tolist()
    bounds = [0, *cuts, total]
    return [e - s for s, e in zip(bounds, bounds[1:])]


def failure(err: Exception) -> dict:
    """A piece that raised, as the JSON records it."""
    return {"error": f"{type(err).__name__}: {err}"[:500]}


def attempt(case, key, save, fn):
    """``case[key] = fn()``, or the error it raised (recorded, not fatal: what was measured before it, and what
    can be measured after it, still reach the JSON); then ``save()``. Returns whether it worked."""
    try:
        case[key] = fn()
        ok = True
    except Exception as err:  # noqa: BLE001 - a failing side is recorded beside what the other measured
        case[key] = failure(err)
        ok = False
    print(f"  {case['dtype']} {key}: {case[key]}", flush=True)
    save()
    return ok


def without_readbacks(fn):
    """``fn`` with mambalab's pre-launch device checks (:class:`mambalab.validate.Finite`,
    :class:`~mambalab.validate.Nondecreasing`) made no-ops for its duration: a diagnostic of what their readback
    costs, never a mode of the library."""
    from mambalab import validate

    def run(*args, **kwargs):
        saved = validate.Finite.check, validate.Nondecreasing.check
        validate.Finite.check = validate.Nondecreasing.check = lambda self: None
        try:
            return fn(*args, **kwargs)
        finally:
            validate.Finite.check, validate.Nondecreasing.check = saved
    return run


def varlen_case(fn_ours, fn_rival, rival, shape, chunk, count, dname, reps, case, save, profile=False):
    """One dtype of the ``--varlen`` mode (module docstring), filled into ``case`` (already in the result)
    piece by piece, ``save()`` after each piece: a rival that fails, or a time limit that stops the run, keeps
    what was measured."""
    b, l, h, hp, g, n = shape
    lengths = varlen_lengths(b * l, count)
    case.update(dtype=dname, lengths=lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    seq = torch.repeat_interleave(torch.arange(count, dtype=torch.int32, device="cuda"),
                                  torch.tensor(lengths, device="cuda"))[None]             # (1, b · l)
    x = make(1, b * l, h, hp, g, n, DTYPES[dname])
    dout = torch.randn(1, b * l, h, hp, device="cuda", dtype=DTYPES[dname])
    ours = dict(reduction="deterministic")
    ok_ours = attempt(case, "mambalab_deterministic", save,
                      lambda: measure(fn_ours, x, dout, chunk, reps, seq_idx=seq, **ours))
    ok_plain = attempt(case, "mambalab_deterministic_no_seq_idx", save,
                       lambda: measure(fn_ours, x, dout, chunk, 1, **ours))
    ok_rival = attempt(case, rival, save, lambda: measure(fn_rival, x, dout, chunk, reps, seq_idx=seq))
    if ok_ours and ok_rival:
        case["ratio_fwd_bwd_deterministic"] = (case["mambalab_deterministic"]["fwd_bwd_ms"]
                                               / case[rival]["fwd_bwd_ms"])
        case["ratio_fwd_deterministic"] = case["mambalab_deterministic"]["fwd_ms"] / case[rival]["fwd_ms"]
    if ok_ours and ok_plain:
        case["masks_cost_fwd_bwd"] = (case["mambalab_deterministic"]["fwd_bwd_ms"]
                                      / case["mambalab_deterministic_no_seq_idx"]["fwd_bwd_ms"])
    save()
    varlen = dict(seq_idx=seq, cu_seqlens=cu, return_varlen_states=True)
    timed = case["varlen_states_fwd_ms"] = {}
    with torch.no_grad():
        for key, fn, kw in (("mambalab", fn_ours, ours), (rival, fn_rival, {})):
            try:
                timed[key] = time_ms(lambda: step(fn, x, dout, chunk, backward=False, **varlen, **kw))
            except Exception as err:  # noqa: BLE001 - recorded, as attempt() does
                timed[key] = failure(err)
    print(f"  {dname} varlen_states_fwd_ms: {timed}", flush=True)
    save()

    def compare():
        with torch.no_grad():
            (o_out, o_states), _ = step(fn_ours, x, dout, chunk, backward=False, **varlen, **ours)
            (t_out, t_states), _ = step(fn_rival, x, dout, chunk, backward=False, **varlen)
        diff = differences(step(fn_ours, x, dout, chunk, seq_idx=seq, **ours),
                           step(fn_rival, x, dout, chunk, seq_idx=seq))
        diff["max_abs_diff"]["varlen_states"] = (o_states.float() - t_states.float()).abs().max().item()
        diff["max_abs_rival"]["varlen_states"] = t_states.float().abs().max().item()
        return diff
    if ok_ours and ok_rival:
        attempt(case, "vs_rival", save, compare)
    if profile:
        attempt(case, "diagnostic_mambalab_without_readbacks", save,
                lambda: measure(without_readbacks(fn_ours), x, dout, chunk, 1, seq_idx=seq, **ours))
        runs = {"mambalab_seq_idx": (fn_ours, dict(seq_idx=seq, **ours)), "mambalab_no_seq_idx": (fn_ours, ours),
                rival: (fn_rival, dict(seq_idx=seq))}
        for key, (fn, kw) in runs.items():
            attempt(case, f"profile_fwd_bwd_{key}", save,
                    lambda: profile_table(lambda: step(fn, x, dout, chunk, **kw), rows=25))
    return case


def stages(x, dout, chunk, reduction):
    """Each kernel launch of mambalab's forward and backward timed alone (where the time goes)."""
    from mambalab.kernels.ssd import backward as bw
    from mambalab.kernels.ssd import chunk_cumsum, chunk_scan, chunk_states, state_passing, state_sweep
    from mambalab.kernels.ssd.forward import ssd_chunk_scan_fwd

    xx, dt, A, B, C, D, bias = (x[k].contiguous() for k in NAMES)
    prec = mambalab.device.dot_precision(xx.dtype, xx.device)   # what the op uses: TF32 dots for fp32 on a GPU
    f = ssd_chunk_scan_fwd(xx, dt, A, B, C, chunk, D=D, dt_bias=bias, dt_softplus=True)
    cfg, lim = f.tiles, (0.0, float("inf"))
    dS, _, da = state_sweep.state_sweep_bwd(dout, None, C, f.dA_cumsum, f.entering_states, None, False, cfg,
                                            reduction, prec)
    sc = chunk_scan.chunk_scan_bwd(dout, xx, B, C, f.delta, f.dA_cumsum, f.entering_states, dS, D, None, cfg,
                                   reduction, prec)
    t = {
        "fwd.chunk_cumsum": lambda: chunk_cumsum.chunk_cumsum_fwd(dt, A, bias, True, lim, cfg),
        "fwd.chunk_states": lambda: chunk_states.chunk_states_fwd(xx, B, f.delta, f.dA_cumsum, cfg, prec),
        "fwd.state_passing": lambda: state_passing.state_passing_fwd(f.chunk_states, f.dA_cumsum, None, cfg),
        "fwd.chunk_scan": lambda: chunk_scan.chunk_scan_fwd(xx, B, C, f.delta, f.dA_cumsum, f.entering_states, D,
                                                           None, cfg, prec),
        "bwd.state_sweep": lambda: state_sweep.state_sweep_bwd(dout, None, C, f.dA_cumsum, f.entering_states, None,
                                                               False, cfg, reduction, prec),
        "bwd.chunk_scan": lambda: chunk_scan.chunk_scan_bwd(dout, xx, B, C, f.delta, f.dA_cumsum,
                                                            f.entering_states, dS, D, None, cfg, reduction, prec),
        "bwd.chunk_cumsum": lambda: chunk_cumsum.chunk_cumsum_bwd(dt, A, bias, True, lim, f.delta, sc[5], sc[6],
                                                                  sc[7], da, sc[8], cfg, reduction),
        "bwd.whole": lambda: bw.ssd_chunk_scan_bwd(dout, None, f, xx, dt, A, B, C, D=D, dt_bias=bias,
                                                   dt_softplus=True, reduction=reduction),
    }
    return {name: time_ms(fn, warmup=3, rep=15) for name, fn in t.items()} | {"tiles": repr(cfg)}


# Tile configurations the sweep tries, as changes to the rule's: forward (block_t, block_k, num_warps), then the
# chunk-scan backward (bwd_block_t, bwd_num_warps). Chosen from the compile reports of benchmarks/ptxas_ssd.py.
SWEEP_FORWARD = [dict(block_t=bt, block_k=bk, num_warps=w) for bt, bk, w in
                 ((64, 64, 8), (64, 128, 8), (128, 64, 8), (32, 64, 4), (64, 64, 4))]
SWEEP_BACKWARD = [dict(bwd_block_t=bt, bwd_num_warps=w) for bt, w in
                  ((32, 8), (32, 4), (64, 8), (64, 4), (16, 4), (128, 8))]
# ``--sweep forward``: the forward's kernels alone, over more of their choices: the chunk scan's (block_t,
# block_k, block_p, num_warps, num_stages), then the chunk states' (states_block_t, states_num_warps) with the rule's
# chunk scan, then C Bᵀ formed by each head's programs and once per group (precompute_cb off and on, whatever the
# rule chose; chunk_cb's launch timed with the chunk scan's).
# ``--sweep backward``: the chunk-scan backward's (bwd_block_t, bwd_num_warps, bwd_num_stages), precompute_cb off and on,
# then the backward sweep's (block_p, num_warps), each kernel timed alone.
SWEEP_FORWARD_WIDE = (
    [dict(block_t=bt, block_k=bk, block_p=bp, num_warps=w) for bt, bk, bp, w in
     ((64, 64, 64, 4), (64, 32, 64, 4), (32, 32, 64, 4), (64, 64, 32, 4), (64, 64, 64, 8), (32, 64, 64, 2))]
    + [dict(num_stages=st) for st in (1, 2, 4)]
    + [dict(states_block_t=bt, states_num_warps=w) for bt, w in ((32, 2), (64, 2), (32, 1), (16, 2), (64, 1))]
    + [dict(precompute_cb=False), dict(precompute_cb=True), dict(precompute_cb=True, num_stages=1),
       dict(precompute_cb=True, num_stages=3)])
SWEEP_BACKWARD_WIDE = (
    [dict(bwd_block_t=bt, bwd_num_warps=w, bwd_num_stages=st) for bt, w, st in
     ((32, 4, 3), (32, 4, 1), (32, 4, 2), (32, 8, 1), (64, 4, 1), (64, 8, 1), (16, 4, 1), (32, 2, 1))]
    + [dict(precompute_cb=False), dict(precompute_cb=True), dict(precompute_cb=True, bwd_num_stages=1)]
    + [dict(sweep_block_p=bp, sweep_num_warps=w) for bp, w in ((32, 4), (16, 4), (16, 2), (32, 2), (32, 8))])


def sweep(x, dout, chunk, part="all", rows=None, save=lambda: None):
    """Forward and backward with other tile configurations (for tuning the rule; deterministic mode).

    ``part="all"``: first the forward's tiles with the rule's backward, then the backward's with the rule's
    forward; each row times the forward, the backward and the chunk-scan backward kernels alone.
    ``part="forward"`` / ``"backward"``: the wider lists above, each kernel they change timed alone. Rows are
    appended to ``rows`` and ``save()`` runs after each, so a run cut short keeps what it measured."""
    import dataclasses

    from mambalab.kernels.ssd import backward as bw
    from mambalab.kernels.ssd import chunk_scan, chunk_states, state_sweep
    from mambalab.kernels.ssd.forward import ssd_chunk_scan_fwd
    from mambalab.kernels.ssd.tiles import tile_config

    xx, dt, A, B, C, D, bias = (x[k].contiguous() for k in NAMES)
    prec = mambalab.device.dot_precision(xx.dtype, xx.device)
    base = tile_config(xx.shape[2], xx.shape[3], B.shape[3], chunk, xx.dtype, ngroups=B.shape[2])
    det = "deterministic"
    forward = lambda cfg: ssd_chunk_scan_fwd(xx, dt, A, B, C, chunk, D=D, dt_bias=bias, dt_softplus=True, cfg=cfg)
    f = forward(base)
    dS = state_sweep.state_sweep_bwd(dout, None, C, f.dA_cumsum, f.entering_states, None, False, base, det, prec)[0]
    timed = lambda fn: time_ms(fn, warmup=2, rep=10)
    scan_bwd = lambda fc, cfg: timed(lambda: chunk_scan.chunk_scan_bwd(
        dout, xx, B, C, fc.delta, fc.dA_cumsum, fc.entering_states, dS, D, None, cfg, det, prec))

    # Each fills ``row`` as it goes, so a configuration that fails part-way keeps what it measured.
    def forward_row(change, row):     # the forward, its chunk states and its chunk scan
        cfg = dataclasses.replace(base, **change)
        fc = forward(cfg)
        row["fwd_ms"] = timed(lambda: forward(cfg))
        row["chunk_states_ms"] = timed(lambda: chunk_states.chunk_states_fwd(xx, B, fc.delta, fc.dA_cumsum, cfg,
                                                                             prec))
        row["chunk_scan_ms"] = timed(lambda: chunk_scan.chunk_scan_fwd(xx, B, C, fc.delta, fc.dA_cumsum,
                                                                       fc.entering_states, D, None, cfg, prec))

    def backward_row(change, row):    # the chunk-scan backward, or the backward sweep
        if "sweep_block_p" in change:
            row["state_sweep_bwd_ms"] = timed(lambda: state_sweep.state_sweep_bwd(
                dout, None, C, f.dA_cumsum, f.entering_states, None, False, base, det, prec,
                block_p=change["sweep_block_p"], num_warps=change["sweep_num_warps"]))
        else:
            row["chunk_scan_bwd_ms"] = scan_bwd(f, dataclasses.replace(base, **change))

    def whole_row(change, row):       # forward and backward through the op's kernels
        cfg = dataclasses.replace(base, **change)
        fc = forward(cfg)
        row["fwd_ms"] = timed(lambda: forward(cfg))
        row["bwd_ms"] = timed(lambda: bw.ssd_chunk_scan_bwd(dout, None, fc, xx, dt, A, B, C, D=D, dt_bias=bias,
                                                            dt_softplus=True))
        row["chunk_scan_bwd_ms"] = scan_bwd(fc, cfg)
        row["fwd_bwd_ms"] = row["fwd_ms"] + row["bwd_ms"]

    changes, time_row = {"forward": (SWEEP_FORWARD_WIDE, forward_row),
                         "backward": (SWEEP_BACKWARD_WIDE, backward_row)}.get(
        part, (SWEEP_FORWARD + SWEEP_BACKWARD, whole_row))
    rows = [] if rows is None else rows
    for change in changes:
        row = dict(change)
        try:
            time_row(change, row)
        except Exception as err:  # a configuration that does not compile is recorded, not fatal
            row["error"] = repr(err)[:300]
        print(row, flush=True)
        rows.append(row)
        save()
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--mamba-deterministic", action="store_true",
                   help="set MAMBA_DETERMINISTIC=1 before importing mamba-ssm (its pinned-config mode)")
    p.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=list(DTYPES))
    p.add_argument("--shape", type=int, nargs=6, default=[4, 4096, 32, 64, 1, 128], metavar=("B", "L", "H", "P", "G", "N"))
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--reps", type=int, default=10, help="repeated backward passes for the bit-pattern count")
    p.add_argument("--stages", action="store_true", help="also time each of mambalab's kernel launches")
    p.add_argument("--sweep", nargs="*", choices=["all", "forward", "backward"],
                   help="also time other tile configurations (forward, backward: each side's kernels alone, more of "
                        "them; no value: all)")
    p.add_argument("--varlen", type=int, default=0, metavar="N",
                   help="packed sequences: the b·l tokens as one row of N sequences (module docstring)")
    p.add_argument("--profile", action="store_true",
                   help="with --varlen: each side's kernels, and mambalab without its device readbacks")
    add_precompile_arguments(p)   # mamba-ssm's default mode autotunes: compile its configurations in parallel first
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("this benchmark needs a CUDA GPU")
    if args.mamba_deterministic:
        os.environ["MAMBA_DETERMINISTIC"] = "1"
    from mambalab import oracle  # mamba-ssm's package imports its CUDA extension at import; the oracle copes
    from mambalab.ops import ssd_chunk_scan

    mamba_chunk_scan_combined = oracle.module("ops.triton.ssd_combined").mamba_chunk_scan_combined
    b, l, h, hp, g, n = args.shape
    if args.compile_part:   # one precompile process: its slice of the rival's configurations, once per dtype
        keep_config_slice("mamba_ssm.ops.triton", args.compile_part)
        for dname in args.dtypes:
            x = make(b, l, h, hp, g, n, DTYPES[dname])
            step(mamba_chunk_scan_combined, x, torch.randn(b, l, h, hp, device="cuda", dtype=DTYPES[dname]),
                 args.chunk)
        torch.cuda.synchronize()
        return
    if args.precompile_rival:   # before any timing: those processes run kernels on the GPU too
        argv = ["--out", args.out, "--dtypes", *args.dtypes, "--shape", *map(str, args.shape), "--chunk",
                str(args.chunk)] + (["--mamba-deterministic"] if args.mamba_deterministic else [])
        precompile_in_parallel(__file__, argv, args.precompile_rival)

    rival = "mamba_ssm_deterministic" if args.mamba_deterministic else "mamba_ssm_default"
    if args.varlen:
        result = {"benchmark": "ssd_chunk_scan_varlen", "rival": rival, "environment": environment(),
                  "shape": {"b": 1, "l": b * l, "h": h, "p": hp, "g": g, "n": n, "chunk": args.chunk,
                            "sequences": args.varlen},
                  "options": "dt_softplus, D (h), dt_bias, seq_idx; cu_seqlens with return_varlen_states in "
                             "varlen_states_fwd_ms; no z, no initial states", "cases": []}
        for dname in args.dtypes:
            case = {}
            result["cases"].append(case)
            varlen_case(ssd_chunk_scan, mamba_chunk_scan_combined, rival, args.shape, args.chunk, args.varlen,
                        dname, args.reps, case, lambda: write(args.out, result, quiet=True), args.profile)
            print(case, flush=True)
        write(args.out, result)
        return
    result = {"benchmark": "ssd_chunk_scan", "rival": rival, "environment": environment(),
              "shape": {"b": b, "l": l, "h": h, "p": hp, "g": g, "n": n, "chunk": args.chunk},
              "options": "dt_softplus, D (h), dt_bias; no z, no initial states", "cases": []}
    for dname in args.dtypes:
        x = make(b, l, h, hp, g, n, DTYPES[dname])
        dout = torch.randn(b, l, h, hp, device="cuda", dtype=DTYPES[dname])
        case = {"dtype": dname}
        for mode in ("deterministic", "atomic"):
            case[f"mambalab_{mode}"] = measure(ssd_chunk_scan, x, dout, args.chunk, args.reps, reduction=mode)
        case[rival] = measure(mamba_chunk_scan_combined, x, dout, args.chunk, args.reps)
        for mode in ("deterministic", "atomic"):
            ours, theirs = case[f"mambalab_{mode}"], case[rival]
            case[f"ratio_fwd_{mode}"] = ours["fwd_ms"] / theirs["fwd_ms"]
            case[f"ratio_fwd_bwd_{mode}"] = ours["fwd_bwd_ms"] / theirs["fwd_bwd_ms"]
        case["vs_rival"] = differences(step(ssd_chunk_scan, x, dout, args.chunk),
                                       step(mamba_chunk_scan_combined, x, dout, args.chunk))
        if args.stages:
            case["stages_ms_deterministic"] = stages(x, dout, args.chunk, "deterministic")
        print(case, flush=True)
        result["cases"].append(case)
        write(args.out, result)  # after every case, so a run cut short keeps what it measured
        for part in ([] if args.sweep is None else args.sweep or ["all"]):
            rows = case.setdefault("tile_sweep" if part == "all" else f"tile_sweep_{part}", [])
            sweep(x, dout, args.chunk, part, rows, lambda: write(args.out, result, quiet=True))
            write(args.out, result)
        del x, dout
    write(args.out, result)


if __name__ == "__main__":
    main()
