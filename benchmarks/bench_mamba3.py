"""Mamba-3 on a GPU, in one process: mambalab's SISO and MIMO scans against mamba-ssm's ``mamba3_siso_combined``,
and the decode step for r = 1, 2, 4, 8.

Shape: b=4, l=4096, h=32 heads, p=64 (headdim), g=1 q/k group, n=128 (d_state), a=32 rotary
pairs (rope_fraction 0.5), bf16 activations, fp32 step sizes, biases and angles.

* scan: forward and forward+backward times of
    - mamba-ssm ``mamba3_siso_combined`` (chunk 64);
    - mambalab ``mamba3_chunk_scan`` SISO (r=1, chunk 64);
    - mambalab MIMO r=4 at the same h, p, n (so the same d_model and state size), chunk 64/r = 16 (mamba-ssm's
      recommendation), 32 and 64;
  distinct bit patterns of the gradients over ``--reps`` backward passes; the largest SISO differences from
  mamba-ssm; ratios (mambalab SISO / mamba-ssm, MIMO r=4 / SISO), all from this one run; then ``--rounds``
  alternating SISO forward+backward timings of both, and the median of their ratios; each side's SISO errors
  against mambalab's fp64 reference; forward+backward replayed as CUDA graphs (GPU time without the host's
  per-call work), SISO both sides and MIMO r=4 at each chunk size.
* ``--mimo-rival``: last, mamba-ssm's MIMO r=4 (``mamba3_mimo``, TileLang) timed the same ways, its MIMO / SISO
  ratio, mambalab's MIMO differences from it and both sides' errors against the fp64 reference (needs
  tilelang==0.1.8 with apache-tvm-ffi 0.1.9: benchmarks/tilelang_wheels.sh). Its MIMO
  turns the rotary pairs (i, i + n/2): :func:`mambalab.oracle.mamba3_scan` hands it q, k and their biases in
  that layout.
* ``--blocks D_MODEL...``: last, whole Mamba3 blocks (in and out projections, norms, the scan between) SISO and
  MIMO r=4, mambalab's and mamba-ssm's with the same weights, forward+backward as CUDA graphs (:func:`blocks`);
  with ``--blocks-only``, nothing else.
* decode: one ``mamba3_step`` for r = 1, 2, 4, 8 at batch ``--decode-batch`` (state read and written once a
  step), with its time (eager, and replayed as a CUDA graph) and the bytes it moves per step.

    python benchmarks/bench_mamba3.py --out DIR [--profile] [--precompile-rival N]   # writes DIR/bench_mamba3.json

Commands instead of that benchmark: the decode step alone, at batch ``--batch`` (64 unless given) and one layer of
the 1024-wide block (h32 p64 g1 n128 a32); the first four write ``--out FILE`` (JSON: environment, command, rows).

    decode               :func:`decode` at r = 1, 2, 4, with each CUDA-graph time over r = 1's
    step-kernel-rates    :func:`step_kernel_rates`: the step kernel's own duration over 8 layers' states
    step-sweep           :func:`step_sweep`: its tile choices
    step-register-sweep  :func:`step_register_sweep`: its register cap
    step-launches        two steps at r = 1, two at r = 4, no timing, no file: the program Nsight Compute profiles
    check-mimo-rival     import mamba-ssm's TileLang MIMO kernels (what ``--mimo-rival`` runs); no GPU, no file
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import mambalab  # noqa: E402,F401
from common import (add_precompile_arguments, distinct_patterns, environment, graph_ms,  # noqa: E402
                    keep_config_slice, precompile_in_parallel, profile_table, time_ms, write)

NAMES = ("q", "k", "v", "adt", "dt", "trap", "q_bias", "k_bias", "angles", "D", "z")
# MIMO r=4 chunk sizes (steps): 16 is mamba-ssm's 64 / r; 32 halves the chunk states 16 writes, 64 quarters them
MIMO_CHUNKS = (16, 32, 64)


def make(b, l, h, p, g, n, a, r, seed=0):
    """Raw inputs as mamba-ssm's module would produce them: trap and angles before sigmoid and π·tanh."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rn = lambda *s: torch.randn(*s, device="cuda", generator=gen)
    dt = F.softplus(rn(b, l, h) - 1.0)
    x = {
        "q": rn(b, l, r, g, n).bfloat16(), "k": rn(b, l, r, g, n).bfloat16(), "v": rn(b, l, h, p).bfloat16(),
        "adt": -dt * torch.exp(0.5 * rn(h)), "dt": dt, "trap": rn(b, l, h),
        "q_bias": 1 + 0.1 * rn(h, r, n), "k_bias": 1 + 0.1 * rn(h, r, n), "angles": rn(b, l, h, a),
        "D": rn(h), "z": rn(b, l, h, p).bfloat16(),
    }
    # the modules' initial values (1/r, 1, 1/r), perturbed by 10 % so that a rank mixed up shows in the comparisons
    mimo = {"mimo_v": (1 + 0.1 * rn(h, r, p)) / r, "mimo_z": 1 + 0.1 * rn(h, r, p),
            "mimo_o": (1 + 0.1 * rn(h, r, p)) / r} if r > 1 else {}
    return x, mimo


def ours(x, mimo, chunk):
    from mambalab.ops import mamba3_chunk_scan

    return mamba3_chunk_scan(x["q"], x["k"], x["v"], x["adt"], x["dt"], torch.sigmoid(x["trap"]), x["q_bias"],
                             x["k_bias"], math.pi * torch.tanh(x["angles"]), x["D"], x["z"], **mimo,
                             chunk_size=chunk)


def theirs(x, mimo, chunk):
    """mamba-ssm's scan on the same inputs (:func:`mambalab.oracle.mamba3_scan`): ``mamba3_siso_combined`` for
    r = 1, ``mamba3_mimo`` (TileLang) with the rank weights. Its times include that adapter's transposes and, for
    MIMO, the copies of q, k and their biases into its rotary layout, made of slices
    (:func:`~mambalab.ref.mamba3.pairs_to_halves`): tensor indexing there would add about 3 ms of backward to
    its MIMO's time."""
    from mambalab import oracle

    return oracle.mamba3_scan(*(x[name] for name in NAMES), **mimo, chunk_size=chunk)


def mimo_rival(x4, m4, dout, reps, siso_graph_ms):
    """mamba-ssm's MIMO r=4 (chunk 16) against its SISO and against mambalab's MIMO: its times (eager, and as a
    CUDA graph), its MIMO / SISO ratio (``siso_graph_ms``: its SISO as a graph, or None), mambalab's largest
    differences from it relative to its largest magnitude, and both sides' errors against the fp64 reference.
    Its times include :func:`theirs`' copies of q, k and their biases into its rotary layout.
    Any failure (TileLang compiles on the first call) is recorded, not raised."""
    out = {}
    try:
        out["times"] = measure(theirs, x4, m4, 16, dout, reps)
        o_t, g_t = run(theirs, x4, m4, 16, dout)
        o_o, g_o = run(ours, x4, m4, 16, dout)
        rel = lambda u, w: ((u.float() - w.float()).abs().max() / w.float().abs().max()).item()
        out["mambalab_vs_mamba_ssm_relative"] = {"out": rel(o_o, o_t),
                                                 **{k: rel(g_o[k], g_t[k]) for k in g_t if g_t[k] is not None}}
        out["errors_vs_fp64_reference"] = reference_errors(x4, m4, dout, {"mambalab": (o_o, g_o),
                                                                           "mamba_ssm": (o_t, g_t)})
        out["graph_ms"] = graph_ms(lambda: run(theirs, x4, m4, 16, dout))
        if siso_graph_ms:
            out["mimo4_over_siso_fwd_bwd_graph"] = out["graph_ms"] / siso_graph_ms
    except Exception as e:  # noqa: BLE001 - keep what was measured, say why the rest is missing
        out["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
    return out


def blocks(d_models, b, l, mimo_rival, profile=False):
    """Whole Mamba3 blocks, forward+backward of (b, l, d_model) bf16 replayed as CUDA graphs: mambalab's
    :class:`~mambalab.modules.Mamba3` SISO (chunk 64) and MIMO r=4 (chunk 16) at each d_model with the
    benchmark's state (d_state 128, headdim 64, one group, rope_fraction 0.5), and mamba-ssm's Mamba3 with the
    same weights (its MIMO only with ``mimo_rival``). The projections around the scan are the same for SISO and
    MIMO but for MIMO's rank-wide B, C and its W's, so a block's MIMO / SISO ratio says what MIMO costs in a
    layer, where the scan's ratio says what it costs in the scan alone. With ``profile``, also where mambalab's
    block spends its time (:func:`common.profile_table`). Failures are recorded, not raised."""
    from mambalab import oracle
    from mambalab.modules import Mamba3

    result = {}
    for d_model in d_models:
        row = {}
        for name, kw in (("siso_c64", dict(is_mimo=False, chunk_size=64)),
                         ("mimo4_c16", dict(is_mimo=True, mimo_rank=4, chunk_size=16))):
            kw = dict(kw, d_state=128, headdim=64, device="cuda", dtype=torch.bfloat16)
            ours_block = Mamba3(d_model, **kw)   # not `ours`: that is the scan function above
            case = {"parameters": sum(t.numel() for t in ours_block.parameters())}
            u = torch.randn(b, l, d_model, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            dout = torch.randn_like(u)
            sides = [("mambalab_ms", ours_block)]
            if mimo_rival or not kw["is_mimo"]:
                try:
                    theirs_block = oracle.module("modules.mamba3").Mamba3(d_model, **kw)
                    theirs_block.load_state_dict(ours_block.state_dict())
                    sides.append(("mamba_ssm_ms", theirs_block))
                except Exception as e:  # noqa: BLE001
                    case["mamba_ssm_ms"] = f"{type(e).__name__}: {str(e)[:500]}"
            for key, block in sides:
                try:
                    case[key] = graph_ms(lambda: block(u).backward(dout))
                    if profile and key == "mambalab_ms":
                        case["mambalab_profile"] = profile_table(lambda: block(u).backward(dout))
                except Exception as e:  # noqa: BLE001
                    case[key] = f"{type(e).__name__}: {str(e)[:500]}"
            if all(isinstance(case.get(k), float) for k in ("mambalab_ms", "mamba_ssm_ms")):
                case["mambalab_over_mamba_ssm"] = case["mambalab_ms"] / case["mamba_ssm_ms"]
            row[name] = case
            print("block", d_model, name, {k: v for k, v in case.items() if k != "mambalab_profile"}, flush=True)
        for key in ("mambalab_ms", "mamba_ssm_ms"):
            if all(isinstance(row[c].get(key), float) for c in ("siso_c64", "mimo4_c16")):
                row[f"mimo4_over_siso_{key[:-3]}"] = row["mimo4_c16"][key] / row["siso_c64"][key]
        result[f"d_model_{d_model}"] = row
    return result


def run(fn, x, mimo, chunk, dout=None):
    """One forward (and, with ``dout``, backward); returns (out, grads by name or None)."""
    leaves = {k: v.detach().requires_grad_(dout is not None) for k, v in x.items()}
    m = {k: v.detach().requires_grad_(dout is not None) for k, v in mimo.items()}
    out = fn(leaves, m, chunk)
    if dout is None:
        return out, None
    out.backward(dout)
    return out, {**{k: v.grad for k, v in leaves.items()}, **{k: v.grad for k, v in m.items()}}


def measure(fn, x, mimo, chunk, dout, reps):
    with torch.no_grad():
        fwd = time_ms(lambda: run(fn, x, mimo, chunk))
    fwd_bwd = time_ms(lambda: run(fn, x, mimo, chunk, dout))
    runs = [run(fn, x, mimo, chunk, dout)[1] for _ in range(reps)]
    return {"fwd_ms": fwd, "fwd_bwd_ms": fwd_bwd, "distinct_grad_patterns": distinct_patterns(runs)}


def compile_part(part: str, shape) -> None:
    """One precompile process (common.precompile_in_parallel): its slice of the rival's configurations, or with
    ``part`` "mimo", mamba-ssm's MIMO r=4 forward and backward once (TileLang compiles each of its three
    kernels, 30-60 s apiece, into its on-disk cache, where the measuring process finds them)."""
    from mambalab import oracle

    b, l, h, p, g, n, a = shape
    if part == "mimo":
        x4, m4 = make(b, l, h, p, g, n, a, 4)
        run(theirs, x4, m4, 16, torch.randn(b, l, h, p, device="cuda").bfloat16())
        torch.cuda.synchronize()
        return
    oracle.module("ops.triton.mamba3.mamba3_siso_combined")
    keep_config_slice("mamba_ssm.ops.triton.mamba3", part)
    x1, m1 = make(b, l, h, p, g, n, a, 1)
    run(theirs, x1, m1, 64, torch.randn(b, l, h, p, device="cuda").bfloat16())
    torch.cuda.synchronize()


def interleaved(x, mimo, dout, rounds):
    """SISO forward+backward, mambalab then mamba-ssm, ``rounds`` times over: [{ours_ms, theirs_ms, ratio}]."""
    out = []
    for _ in range(rounds):
        mine = time_ms(lambda: run(ours, x, mimo, 64, dout), rep=100)
        rival = time_ms(lambda: run(theirs, x, mimo, 64, dout), rep=100)
        out.append({"ours_ms": mine, "theirs_ms": rival, "ratio": mine / rival})
    return out


def step_inputs(batch, h, p, g, n, a, r):
    """One token's inputs to ``mamba3_step`` (seed 1; trap and angles through sigmoid and π·tanh, as the
    module applies them), and the MIMO weights ({} at r = 1)."""
    x, mimo = make(batch, 1, h, p, g, n, a, r, seed=1)
    tok = {k: (v[:, 0] if k in ("q", "k", "v", "adt", "dt", "trap", "angles", "z") else v) for k, v in x.items()}
    tok["trap"], tok["angles"] = torch.sigmoid(tok["trap"]), math.pi * torch.tanh(tok["angles"])
    return tok, mimo


def random_ssm_state(batch, h, p, n, r, a):
    """A decode state whose SSM part is random (the rest zero), fp32 on the GPU."""
    from mambalab.ref.mamba3 import zero_state

    state = zero_state(batch, h, p, n, r, a, torch.float32, "cuda")
    return type(state)(*(torch.randn_like(t) if i == 1 else t for i, t in enumerate(state)))


def ssm_step_bytes(state_numel, tok, mimo):
    """The bytes a step moves as the sweeps count them: the fp32 SSM state read and written once, and the
    token's inputs and MIMO weights. The angle, k and v states are left out (at batch 64, h32 p64 n128 a32 they
    would add 3 % at r = 1 and 7 % at r = 4); :func:`decode` counts every part of the state."""
    return 2 * state_numel * 4 + sum(t.numel() * t.element_size() for t in tok.values()) \
        + sum(t.numel() * 4 for t in mimo.values())


def step_kernel_rates(batch, h, p, g, n, a, ranks=(1, 2, 4), layers=8):
    """The step kernel's own rate at the memory limit: ``layers`` states of one shape (a model's layers, so no
    state is still in L2 when its next step reads it), one step on each.

    Per rank: the kernel's mean duration from torch.profiler (CUPTI's device times, no launch or replay in
    them) and the time per step of a CUDA graph of the ``layers`` steps (what a captured decode loop sees,
    gaps between kernels included); bytes by :func:`ssm_step_bytes`. First row: a plain copy of one fp32
    state (``copy_``, a device-to-device copy), timed the same two ways."""
    from mambalab.ops import mamba3_step

    state_numel = batch * h * p * n
    src = [torch.randn(state_numel, device="cuda") for _ in range(layers)]
    dst = [torch.empty_like(t) for t in src]
    rows = [_kernel_and_graph_times("copy of the fp32 state", lambda: [d.copy_(s) for d, s in zip(dst, src)],
                                    layers, 8 * state_numel, ("memcpy", "copy"))]
    del src, dst
    for r in ranks:
        tok, mimo = step_inputs(batch, h, p, g, n, a, r)
        states = [random_ssm_state(batch, h, p, n, r, a) for _ in range(layers)]
        moved = ssm_step_bytes(state_numel, tok, mimo)
        with torch.no_grad():
            row = _kernel_and_graph_times(f"step r={r}", lambda: [mamba3_step(s, **tok, **mimo) for s in states],
                                          layers, moved, ("mamba3_step_kernel",))
        rows.append(dict(row, r=r, batch=batch))
        del states
    for row in rows:
        print("step kernel", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}, flush=True)
    return rows


def step_register_sweep(batch, h, p, g, n, a, layers=8):
    """The step kernel's register cap (Triton's ``maxnreg``) and a few tiles, timed as :func:`step_kernel_rates`
    times the rule's choice: fewer registers a thread let more programs share a multiprocessor (Nsight Compute
    saw 123-128 registers and 23 % achieved occupancy at batch 64), at the risk of spills."""
    from mambalab.kernels.mamba3 import step as step_kernel
    from mambalab.ops import mamba3_step

    default = step_kernel.step_config
    state_numel = batch * h * p * n
    trials = {1: [{}, dict(maxnreg=96), dict(maxnreg=80), dict(maxnreg=64), dict(BLOCK_P=8, num_warps=1),
                  dict(BLOCK_P=8, num_warps=1, maxnreg=64), dict(BLOCK_P=16, num_warps=4, maxnreg=64)],
              2: [{}, dict(maxnreg=96), dict(maxnreg=64)],
              4: [{}, dict(maxnreg=96), dict(maxnreg=80), dict(maxnreg=64), dict(BLOCK_P=4),
                  dict(BLOCK_P=4, maxnreg=64), dict(BLOCK_P=16, num_warps=2, maxnreg=64)]}
    rows = []
    try:
        for r, changes in trials.items():
            tok, mimo = step_inputs(batch, h, p, g, n, a, r)
            states = [random_ssm_state(batch, h, p, n, r, a) for _ in range(layers)]
            moved = ssm_step_bytes(state_numel, tok, mimo)
            for change in changes:
                choice = dict(default(batch, h, p, r), **change)
                step_kernel.step_config = lambda *_, c=choice: dict(c)
                try:
                    with torch.no_grad():
                        row = _kernel_and_graph_times(f"step r={r}", lambda: [mamba3_step(s, **tok, **mimo)
                                                                              for s in states],
                                                      layers, moved, ("mamba3_step_kernel",))
                except Exception as e:  # noqa: BLE001 - a choice that does not compile is recorded
                    row = {"case": f"step r={r}", "error": f"{type(e).__name__}: {e}"[:300]}
                finally:
                    step_kernel.step_config = default
                rows.append(dict(row, r=r, batch=batch, **choice))
                print("step registers", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in rows[-1].items()},
                      flush=True)
            del states
    finally:
        step_kernel.step_config = default
    return rows


def _kernel_and_graph_times(case, fn, layers, moved, names):
    """One row of :func:`step_kernel_rates`: ``fn`` runs ``layers`` launches; the profiler rows whose names
    contain one of ``names`` give the kernel's mean µs; the CUDA graph of ``fn`` gives µs per launch."""
    prof = profile_table(fn, steps=5, rows=40)
    hits = [e for e in prof if any(k in e["name"].lower() for k in names) and e["calls_per_step"] >= layers]
    row = {"case": case, "bytes": moved}
    if hits:
        kernel_us = 1e3 * hits[0]["self_ms_per_step"] / hits[0]["calls_per_step"]
        row.update(kernel_name=hits[0]["name"][:80], kernel_us=kernel_us, kernel_GB_per_s=moved / kernel_us / 1e3)
    else:
        row["kernel_us"] = f"no profiler row named {names}: {[e['name'][:60] for e in prof[:6]]}"
    graph_us = 1e3 * graph_ms(fn) / layers
    row.update(graph_us_per_step=graph_us, graph_GB_per_s=moved / graph_us / 1e3)
    return row


def decode(batch, h, p, g, n, a, r):
    """Time one mamba3_step; bytes = state in + state out + the token's inputs."""
    from mambalab.ops import mamba3_step
    from mambalab.ref.mamba3 import zero_state

    tok, mimo = step_inputs(batch, h, p, g, n, a, r)
    state = zero_state(batch, h, p, n, r, a, torch.float32, "cuda")
    with torch.no_grad():
        ms = time_ms(lambda: mamba3_step(state, **tok, **mimo), warmup=10, rep=100)
        try:   # the kernel's time without the host's per-call work (a decoding loop runs in a CUDA graph)
            graphed = graph_ms(lambda: mamba3_step(state, **tok, **mimo))
        except Exception as e:  # noqa: BLE001 - keep the eager time, say why there is no graph time
            graphed = f"{type(e).__name__}: {e}"
    state_bytes = sum(t.numel() * 4 for t in state)
    token_bytes = sum(t.numel() * t.element_size() for t in tok.values()) + sum(t.numel() * 4 for t in mimo.values())
    moved = 2 * state_bytes + token_bytes
    flops = batch * h * (6 * r * p * n)   # β U_prev, γ U (2 r p n each, fused multiply-adds) and H q̂ per rank
    graph_rate = moved / graphed / 1e6 if isinstance(graphed, float) else None   # the kernels' own rate
    return {"r": r, "batch": batch, "ms": ms, "graph_ms": graphed, "bytes": moved, "GB_per_s": moved / ms / 1e6,
            "graph_GB_per_s": graph_rate, "flops": flops, "flops_per_byte": flops / moved}


def step_sweep(batch, h, p, g, n, a, ranks=(1, 2, 4)):
    """The decode step's tile choices at one shape, replayed as CUDA graphs (:func:`common.graph_ms`): for each
    rank, each way through the ranks (loop on the state's pairs, register tile, loop on the state's rows as they
    lie; :func:`mambalab.kernels.mamba3.step_config` and the kernel's docstring) at a few BLOCK_P and warps, with the state read and written plainly or with
    evict_first (STREAM). Each row: µs, GB/s (:func:`ssm_step_bytes`) and the largest |difference| from
    the default choice's output and state, relative to their largest magnitude. First row: a plain copy of the
    state (read once, written once), the rate a step that only moved the state would reach."""
    from mambalab.kernels.mamba3 import step as step_kernel
    from mambalab.ops import mamba3_step

    state_numel = batch * h * p * n
    src = torch.randn(state_numel, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = graph_ms(lambda: dst.copy_(src))
    rows = [{"case": "copy of the fp32 state", "us": copy_ms * 1e3, "GB_per_s": 8 * state_numel / copy_ms / 1e6}]
    ways = [dict(FLAT=False), dict(FLAT=True)]
    tiles = [dict(BLOCK_P=16, num_warps=2), dict(BLOCK_P=16, num_warps=4), dict(BLOCK_P=8, num_warps=1)]
    default = step_kernel.step_config
    try:
        for r in ranks:
            tok, mimo = step_inputs(batch, h, p, g, n, a, r)
            state = random_ssm_state(batch, h, p, n, r, a)
            moved = ssm_step_bytes(state_numel, tok, mimo)
            with torch.no_grad():
                base_out, base_state = mamba3_step(state, **tok, **mimo)
                for way in ways:
                    for tile in tiles:
                        for stream in (False, True):
                            choice = dict(**way, **tile, STREAM=stream)
                            row = dict(r=r, batch=batch, heads=h, **choice)
                            step_kernel.step_config = lambda *_, c=choice: dict(c)
                            try:
                                out, new = mamba3_step(state, **tok, **mimo)
                                rel = lambda u, w: ((u.float() - w.float()).abs().max() / w.float().abs().max()).item()
                                row["out_rel_diff"] = rel(out, base_out)
                                row["state_rel_diff"] = rel(new.ssm, base_state.ssm)
                                ms = graph_ms(lambda: mamba3_step(state, **tok, **mimo))
                                row.update(us=ms * 1e3, GB_per_s=moved / ms / 1e6)
                            except Exception as e:  # noqa: BLE001 - a choice that does not compile is recorded
                                row["error"] = f"{type(e).__name__}: {e}"[:300]
                            finally:
                                step_kernel.step_config = default
                            rows.append(row)
                            print("step sweep", {k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()},
                                  flush=True)
    finally:
        step_kernel.step_config = default
    return rows


def reference_errors(x, mimo, dout, results):
    """The largest |error| of mambalab's and of mamba-ssm's output and gradients against mambalab's fp64
    reference (ref.mamba3_chunked on the same inputs, sigmoid and π·tanh taken in fp64), relative to the
    reference's largest magnitude. Says which side of a difference between the two is the error.
    mimo: the rank weights ({} for SISO). results: {"mambalab": (out, grads), "mamba_ssm": (out, grads)}, each
    side's :func:`run` on x, mimo and dout."""
    from mambalab.ref.mamba3 import mamba3_chunked

    leaves = {k: v.detach().double().requires_grad_(True) for k, v in {**x, **mimo}.items()}
    want = mamba3_chunked(leaves["q"], leaves["k"], leaves["v"], leaves["adt"], leaves["dt"],
                          torch.sigmoid(leaves["trap"]), leaves["q_bias"], leaves["k_bias"],
                          math.pi * torch.tanh(leaves["angles"]), leaves["D"], leaves["z"],
                          **{k: leaves[k] for k in mimo}, chunk_size=64)
    want.backward(dout.double())
    ref = {"out": want.detach(), **{k: v.grad for k, v in leaves.items()}}
    del want, leaves
    errors = {}
    for side, (out, grads) in results.items():
        got = {"out": out, **grads}
        errors[side] = {k: ((got[k].double() - ref[k]).abs().max() / ref[k].abs().max()).item() for k in ref}
    return errors


# The decode-step commands' shape: h, p, g, n, a of one layer of the 1024-wide block (the scan's default heads)
STEP_SHAPE = (32, 64, 1, 128, 32)


def _write_rows(out: str, rows: list) -> None:
    write(out, {"environment": environment(), "command": "bench_mamba3.py " + " ".join(sys.argv[1:]), "rows": rows})


def decode_command(args) -> None:
    rows = [decode(args.batch, *STEP_SHAPE, r) for r in (1, 2, 4)]
    base = rows[0]["graph_ms"]
    for row in rows:
        graphed = isinstance(row["graph_ms"], float) and isinstance(base, float)
        row["graph_over_r1"] = row["graph_ms"] / base if graphed else None
        graph = f"{row['graph_ms'] * 1e3:.1f} us" if isinstance(row["graph_ms"], float) else row["graph_ms"]
        print(f"decode b{args.batch} r={row['r']}: eager {row['ms'] * 1e3:.1f} us, graph {graph}, "
              f"graph GB/s {row['graph_GB_per_s']}", flush=True)
    _write_rows(args.out, rows)


def step_launches(batch: int) -> None:
    """Two decode steps at r = 1, then two at r = 4, untimed (the program ``ncu -c 4`` profiles)."""
    from mambalab.ops import mamba3_step

    h, p, g, n, a = STEP_SHAPE
    with torch.no_grad():
        for r in (1, 1, 4, 4):
            tok, mimo = step_inputs(batch, h, p, g, n, a, r)
            mamba3_step(random_ssm_state(batch, h, p, n, r, a), **tok, **mimo)
    torch.cuda.synchronize()
    print(f"ran 4 decode steps at batch {batch}: r = 1, 1, 4, 4")


def check_mimo_rival() -> None:
    """Exit non-zero, saying why, unless mamba-ssm's TileLang MIMO kernels import."""
    from mambalab import oracle

    try:
        oracle.module("ops.tilelang.mamba3.mamba3_mimo")
        import tilelang
    except Exception as e:  # noqa: BLE001 - the reason is the report
        sys.exit(f"mamba-ssm's MIMO kernels do not import: {type(e).__name__}: {e}")
    print("tilelang", tilelang.__version__, "and mamba-ssm's MIMO kernels import")


COMMANDS = {   # name: (what it runs, its help, its options)
    "decode": (decode_command, "decode at r = 1, 2, 4, each CUDA-graph time over r = 1's", ("--batch", "--out")),
    "step-kernel-rates": (lambda args: _write_rows(args.out, step_kernel_rates(args.batch, *STEP_SHAPE)),
                          "the step kernel's own duration over 8 layers' states", ("--batch", "--out")),
    "step-sweep": (lambda args: _write_rows(args.out, step_sweep(args.batch, *STEP_SHAPE)),
                   "the step kernel's tile choices", ("--batch", "--out")),
    "step-register-sweep": (lambda args: _write_rows(args.out, step_register_sweep(args.batch, *STEP_SHAPE)),
                            "the step kernel's register cap", ("--batch", "--out")),
    "step-launches": (lambda args: step_launches(args.batch),
                      "two steps at r = 1, two at r = 4, untimed: the program Nsight Compute profiles", ("--batch",)),
    "check-mimo-rival": (lambda args: check_mimo_rival(),
                         "import mamba-ssm's TileLang MIMO kernels (what --mimo-rival runs); needs no GPU", ()),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="directory for bench_mamba3.json (required unless a command is given)")
    ap.add_argument("--shape", type=int, nargs=7, default=[4, 4096, 32, 64, 1, 128, 32],
                    metavar=("B", "L", "H", "P", "G", "N", "A"))
    ap.add_argument("--reps", type=int, default=5, help="repeated backward passes for the bit-pattern count")
    ap.add_argument("--decode-batch", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5,
                    help="alternating SISO forward+backward timings of mambalab and mamba-ssm, for a ratio from "
                         "neighbouring times")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the output gradient dout (the inputs use seed 0 and 1): the errors against the "
                         "fp64 reference, d angles' above all, move with dout, so runs compare on one seed")
    ap.add_argument("--profile", action="store_true",
                    help="also record where mambalab's SISO and MIMO r=4 forward+backward spend their time")
    ap.add_argument("--mimo-rival", action="store_true",
                    help="last of all, also time mamba-ssm's MIMO r=4 (TileLang; needs tilelang==0.1.8 importable)")
    ap.add_argument("--blocks", type=int, nargs="*", default=[], metavar="D_MODEL",
                    help="last, also time whole Mamba3 blocks (SISO and MIMO r=4, both sides) at these d_model, "
                         "at the shape's b and l (1024 gives the shape's 32 heads)")
    ap.add_argument("--blocks-only", action="store_true",
                    help="time the --blocks alone: skip the scans, the decode step and the rival's scans")
    add_precompile_arguments(ap)   # the rival autotunes ~190 configurations: compile them in parallel first
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", title="commands instead of the scan benchmark")
    for name, (_, summary, options) in COMMANDS.items():
        p = sub.add_parser(name, help=summary, description=summary)
        if "--batch" in options:
            p.add_argument("--batch", type=int, default=64,
                           help=f"decode batch (default 64), at h, p, g, n, a = {', '.join(map(str, STEP_SHAPE))}")
        if "--out" in options:
            p.add_argument("--out", required=True, help="JSON file to write")
    args = ap.parse_args()
    if args.command == "check-mimo-rival":
        return check_mimo_rival()
    if not torch.cuda.is_available():
        sys.exit("bench_mamba3 needs a CUDA GPU")
    if args.command:
        return COMMANDS[args.command][0](args)
    if not args.out:
        ap.error("--out DIR is required without a command")
    if args.compile_part:
        compile_part(args.compile_part, args.shape)
        return
    if args.precompile_rival:   # first: those processes also run kernels on the GPU, which would skew timings
        precompile_in_parallel(__file__, ["--out", args.out, "--shape", *map(str, args.shape)], args.precompile_rival,
                               ("mimo",) if args.mimo_rival else ())
    b, l, h, p, g, n, a = args.shape
    result = {"environment": environment(), "shape": dict(b=b, l=l, h=h, p=p, g=g, n=n, a=a), "dtype": "bf16",
              "dout_seed": args.seed}
    if args.blocks_only:
        if not args.blocks:
            sys.exit("--blocks-only needs --blocks D_MODEL...")
        result["blocks_fwd_bwd_graph"] = blocks(args.blocks, b, l, args.mimo_rival, args.profile)
        write(Path(args.out) / "bench_mamba3.json", result)
        return

    x1, m1 = make(b, l, h, p, g, n, a, 1)
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    dout = torch.randn(b, l, h, p, device="cuda", generator=gen).bfloat16()
    scan = {}
    # Ours first: mamba-ssm's Mamba-3 kernels autotune on their first call over about 190 configurations
    # (27 for its forward, 54 + 27 + 27 + 54 for its backward kernels), minutes of compiling on a fresh machine
    # (--precompile-rival spreads that compiling over processes beforehand).
    scan["mambalab_siso_c64"] = measure(ours, x1, m1, 64, dout, args.reps)
    print("mambalab_siso_c64", scan["mambalab_siso_c64"], flush=True)  # progress, for runs cut short
    x4, m4 = make(b, l, h, p, g, n, a, 4)
    for chunk in MIMO_CHUNKS:
        scan[f"mambalab_mimo4_c{chunk}"] = measure(ours, x4, m4, chunk, dout, args.reps)
        print(f"mambalab_mimo4_c{chunk}", scan[f"mambalab_mimo4_c{chunk}"], flush=True)
    result["scan"] = scan
    if args.profile:   # one table per case: kernels and PyTorch operators, device time per forward+backward
        result["profile"] = {"mambalab_siso_c64": profile_table(lambda: run(ours, x1, m1, 64, dout)),
                             "mambalab_mimo4_c16": profile_table(lambda: run(ours, x4, m4, 16, dout))}
        write(Path(args.out) / "bench_mamba3.json", result)
    # The decode step (ours alone) before the rival, so a run cut short in its autotuning keeps it.
    steps = [decode(args.decode_batch, h, p, g, n, a, r) for r in (1, 2, 4, 8)]
    for s in steps:
        s["ms_over_r1"] = s["ms"] / steps[0]["ms"]
    result["decode"] = steps
    siso = scan["mambalab_siso_c64"]["fwd_bwd_ms"]
    ratios = {f"mimo4_c{c}_over_siso_fwd_bwd": scan[f"mambalab_mimo4_c{c}"]["fwd_bwd_ms"] / siso for c in MIMO_CHUNKS}
    result["ratios"] = ratios
    result["targets"] = {"siso_over_mamba_ssm_fwd_bwd": 1.2, "mimo4_over_siso_fwd_bwd": 1.5}
    write(Path(args.out) / "bench_mamba3.json", result)
    for s in steps:
        print(f"decode r={s['r']}: {s['ms'] * 1e3:.1f} us, {s['GB_per_s']:.0f} GB/s, {s['flops_per_byte']:.2f} flop/B",
              flush=True)

    try:
        scan["mamba_ssm_siso_c64"] = measure(theirs, x1, m1, 64, dout, args.reps)
    except Exception as e:  # noqa: BLE001 - record why the rival did not run, keep what we measured
        scan["mamba_ssm_siso_c64"] = {"error": f"{type(e).__name__}: {e}"}
    print("mamba_ssm_siso_c64", scan["mamba_ssm_siso_c64"], flush=True)
    if "error" not in scan["mamba_ssm_siso_c64"]:
        o, go = run(ours, x1, m1, 64, dout)
        t, gt = run(theirs, x1, m1, 64, dout)
        result["siso_vs_mamba_ssm"] = {
            "max_abs_diff": {"out": (o.float() - t.float()).abs().max().item(),
                             **{k: (go[k].float() - gt[k].float()).abs().max().item() for k in NAMES}},
            "max_abs_mamba_ssm": {"out": t.float().abs().max().item(),
                                  **{k: gt[k].float().abs().max().item() for k in NAMES}},
        }
        ratios["siso_over_mamba_ssm_fwd_bwd"] = siso / scan["mamba_ssm_siso_c64"]["fwd_bwd_ms"]
        ratios["siso_over_mamba_ssm_fwd"] = scan["mambalab_siso_c64"]["fwd_ms"] / scan["mamba_ssm_siso_c64"]["fwd_ms"]
        # The times above were taken minutes apart; both ops are short enough (~3 ms, dozens of launches) for
        # the host's pace to show in them. Rounds that alternate the two give a ratio from neighbouring times.
        rounds = interleaved(x1, m1, dout, args.rounds)
        result["siso_interleaved_fwd_bwd"] = rounds
        ratios["siso_over_mamba_ssm_fwd_bwd_interleaved_median"] = statistics.median(r["ratio"] for r in rounds)
        write(Path(args.out) / "bench_mamba3.json", result)
        try:
            result["siso_errors_vs_fp64_reference"] = reference_errors(
                x1, {}, dout, {"mambalab": (o, go), "mamba_ssm": (t, gt)})
        except Exception as e:  # noqa: BLE001
            result["siso_errors_vs_fp64_reference"] = f"{type(e).__name__}: {e}"
        write(Path(args.out) / "bench_mamba3.json", result)
        # Last (a failed capture can leave the device unusable), the rival last of all: forward+backward as
        # CUDA graphs, the host's per-call work gone, so what remains is the GPU time of each side's kernels.
        graphed = {}
        cases = [("mambalab_siso_c64", ours, x1, m1, 64)]
        cases += [(f"mambalab_mimo4_c{c}", ours, x4, m4, c) for c in MIMO_CHUNKS]
        for name, fn, x, m, chunk in cases + [("mamba_ssm_siso_c64", theirs, x1, m1, 64)]:
            try:
                graphed[name] = graph_ms(lambda: run(fn, x, m, chunk, dout))
            except Exception as e:  # noqa: BLE001
                graphed[name] = f"{type(e).__name__}: {e}"
            print("graph", name, graphed[name], flush=True)
        result["fwd_bwd_graph_ms"] = graphed
        if all(isinstance(graphed[k], float) for k in graphed):
            ratios["siso_over_mamba_ssm_fwd_bwd_graph"] = graphed["mambalab_siso_c64"] / graphed["mamba_ssm_siso_c64"]
            for c in MIMO_CHUNKS:
                mimo_ms = graphed[f"mambalab_mimo4_c{c}"]
                ratios[f"mimo4_c{c}_over_siso_fwd_bwd_graph"] = mimo_ms / graphed["mambalab_siso_c64"]
    if args.mimo_rival:   # last: its kernels compile on the first call, and may fail to
        graphed = result.get("fwd_bwd_graph_ms", {})
        siso_graph = graphed.get("mamba_ssm_siso_c64")
        result["mamba_ssm_mimo4_c16"] = mimo_rival(x4, m4, dout, args.reps,
                                                   siso_graph if isinstance(siso_graph, float) else None)
        print("mamba_ssm_mimo4_c16", result["mamba_ssm_mimo4_c16"], flush=True)
    write(Path(args.out) / "bench_mamba3.json", result)
    if args.blocks:
        result["blocks_fwd_bwd_graph"] = blocks(args.blocks, b, l, args.mimo_rival, args.profile)
        write(Path(args.out) / "bench_mamba3.json", result)
    print({k: round(v, 3) for k, v in ratios.items()})


if __name__ == "__main__":
    main()
