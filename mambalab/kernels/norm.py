"""The norms' forward and backward as Triton kernels: the gated RMS/Layer norm of Mamba-2's mixer output
(:func:`mambalab.modules.norm.layernorm_fn`) and the residual add fused with a norm between blocks
(:func:`mambalab.ops.layer_norm_fn`). One kernel family for both: the fused add-norm is the gated norm with one
group, no gate, and a residual stream; each reads its inputs once and writes its outputs once.

Math, per row and group of ``group_size`` channels (G = d / group_size groups):

    s = x + r                     with a residual r; s is stored in the stream's dtype (rounded once), and the
                                  norm reads the fp32 sum (mamba-ssm's fused add-norm) or the stored s
                                  (NORM_STORED_S: what PyTorch's ``r + x`` then the norm computes)
    v = s ⊙ silu(z) if z is given and not norm_before_gate, else s      (s = x without a residual)
    μ = Σ_j v_j / N (LayerNorm; μ = 0 for RMSNorm),  σ⁻¹ = 1 / sqrt(Σ_j (v_j - μ)² / N + eps),  N = group_size
    v̂ = (v - μ) σ⁻¹,   y = v̂ ⊙ w + b,  then y ⊙ silu(z) if norm_before_gate

Backward, per row and group, in fp32, v̂ recomputed from the stored input (x or s, and z) with the saved μ, σ⁻¹;
with e the gradient reaching v̂ ⊙ w + b (dy, or dy ⊙ silu(z) when the gate comes after the norm):

    g = e ⊙ w,   c₁ = Σ_j v̂_j g_j / N,   c₂ = Σ_j g_j / N (0 for RMSNorm)
    dv = (g - (v̂ c₁ + c₂)) σ⁻¹
    dz = dy ⊙ (v̂ ⊙ w + b) ⊙ silu'(z) (gate after), or dv ⊙ s ⊙ silu'(z) and dv ← dv ⊙ silu(z) (gate before)
    dx = dresidual = dv + ds   (ds: the gradient of the returned s, prenorm)
    dw = Σ_rows e ⊙ v̂,   db = Σ_rows e

dw and db: each program of the backward takes ROWS_PER_PROGRAM consecutive rows (the last program fewer) of
GROUPS groups, adds its rows' e ⊙ v̂ (and e) into fp32 accumulators one row at a time in row order, and writes
them to row p of a (P, d) partials buffer, P = cdiv(M, ROWS_PER_PROGRAM);
:func:`mambalab.kernels.reduce.sum_partials` folds the P partials in its order, fixed by P. Every tile size
here is fixed by the shape alone (no autotune, no SM count): mamba-ssm's norm backwards size their partials by
the GPU's ``sm_count``, which is what makes an RTX 4090 and an RTX A6000 disagree on their weight gradients;
here the bits are the same on every GPU and every run, and the same for any split of the M rows into (b, l).

Tiles (BLOCK = next_pow2(group_size)): the forward takes BLOCK_M (row, group) pairs a program, a [BLOCK_M, BLOCK]
tile (BLOCK_M = FWD_TILE // BLOCK, 1 to 64: small groups get many a program, so the interpreter and the GPU run
fewer programs); the backward a [GROUPS, BLOCK] tile of one row at a time (GROUPS = BWD_TILE // BLOCK, 1 to G).
Warps: mamba-ssm's rule, min(max(elements / 256, 1), 8), by the tile's elements.

One module for both norms, not two: the fused add-norm differs from the gated norm only by constexpr flags
(HAS_RESIDUAL, STORE_S, HAS_DS, STORE_DRES), so a second kernel family would repeat the same math.

Shapes and dtypes: x, z, r, y, s, dy, ds, dx, dz, dr (M, d), unit stride along d, rows at any stride; w, b (d,);
μ, σ⁻¹ (M, G) fp32. On a GPU the kernels read and write the tensors' own dtypes (fp32 / fp16 / bf16) and
compute in fp32; on the CPU the interpreter's bf16 stores do not round to nearest, so the launchers feed and
take fp32 there (:func:`mambalab.device.compute_dtype`) and PyTorch rounds the outputs (so there NORM_STORED_S
reads the fp32 sum: the one caller, add_norm, takes the kernel on a GPU only).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.standard import _sum_combine

from mambalab import device
from mambalab.kernels.reduce import sum_partials

ROWS_PER_PROGRAM = 64   # backward rows a program: P = cdiv(M, 64) partials of dw, db; part of the sums' order
FWD_TILE = 4096         # forward tile elements: BLOCK_M = FWD_TILE // BLOCK (row, group) pairs (1 to 64) a program
# tl.sum(v, axis) is tl.reduce(v, axis, _sum_combine) inside a @triton.jit wrapper, and tl.sigmoid(z) is
# 1 / (1 + exp(-z)) inside one: the same code compiled, but Triton's interpreter patches triton.language at every
# call of a jit function (once a launch under mambalab.device's patch), so on the CPU each call costs more than
# the work it does, and the kernels spell them out.
BWD_TILE = 2048         # backward tile elements: GROUPS = BWD_TILE // BLOCK groups (1 to G) of a row a program


@triton.jit
def norm_fwd_kernel(
    x_ptr,            # (M, d) x
    z_ptr,            # (M, d) the gate z (HAS_Z), else a dummy
    res_ptr,          # (M, d) the residual r (HAS_RESIDUAL), else a dummy
    w_ptr,            # (d,) weight
    b_ptr,            # (d,) bias (HAS_BIAS), else a dummy
    y_ptr,            # (M, d) out
    s_ptr,            # (M, d) the stream s = x + r in its dtype (STORE_S), else a dummy
    mean_ptr,         # (M, G) fp32 μ (STORE_STATS and not IS_RMS), else a dummy
    rstd_ptr,         # (M, G) fp32 σ⁻¹ (STORE_STATS), else a dummy
    M, G, group_size,
    x_row, z_row, r_row, y_row, s_row,   # row strides (elements)
    eps,
    HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, IS_RMS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, STORE_S: tl.constexpr, NORM_STORED_S: tl.constexpr, STORE_STATS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
):
    # BLOCK_M (row, group) pairs a program, k = row · G + group: the layout of μ and σ⁻¹
    k = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row = (k // G)[:, None]
    cols = tl.arange(0, BLOCK)
    col_ok = cols < group_size
    pair_ok = k < M * G
    mask = pair_ok[:, None] & col_ok[None, :]
    offs = (k % G)[:, None] * group_size + cols[None, :]                 # each pair's channels
    v = tl.load(x_ptr + row * x_row + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        v += tl.load(res_ptr + row * r_row + offs, mask=mask, other=0.0).to(tl.float32)
    if STORE_S:   # the stream's next value, rounded once to its dtype
        s = v.to(s_ptr.dtype.element_ty)
        tl.store(s_ptr + row * s_row + offs, s, mask=mask)
        if NORM_STORED_S:
            v = s.to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + row * z_row + offs, mask=mask, other=0.0).to(tl.float32)
        gate = z / (1.0 + tl.exp(-z))                                    # silu(z)
        if not NORM_BEFORE_GATE:
            v = v * gate
    if not IS_RMS:
        mean = tl.reduce(v, 1, _sum_combine) / group_size                # (BLOCK_M,)
        v = tl.where(mask, v - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.reduce(v * v, 1, _sum_combine) / group_size + eps)   # (BLOCK_M,)
    y = v * rstd[:, None] * tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_Z and NORM_BEFORE_GATE:
        y = y * gate
    tl.store(y_ptr + row * y_row + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    if STORE_STATS:
        tl.store(rstd_ptr + k, rstd, mask=pair_ok)
        if not IS_RMS:
            tl.store(mean_ptr + k, mean, mask=pair_ok)


@triton.jit
def norm_bwd_kernel(
    x_ptr,            # (M, d) the input the forward normalised: x, or the stored s
    z_ptr,            # (M, d) the gate z (HAS_Z), else a dummy
    w_ptr,            # (d,) weight
    b_ptr,            # (d,) bias (HAS_BIAS), else a dummy
    mean_ptr,         # (M, G) fp32 μ (not IS_RMS), else a dummy
    rstd_ptr,         # (M, G) fp32 σ⁻¹
    dy_ptr,           # (M, d) the gradient of y
    ds_ptr,           # (M, d) the gradient of the returned s (HAS_DS), else a dummy
    dx_ptr,           # (M, d) out: the gradient of x
    dz_ptr,           # (M, d) out: the gradient of z (HAS_Z), else a dummy
    dres_ptr,         # (M, d) out: the gradient of the residual (STORE_DRES), else a dummy
    partials_ptr,     # (P, 1 + HAS_DB, d) fp32 out: program p's Σ e ⊙ v̂ at [p, 0], Σ e at [p, 1]
    M, G, group_size,
    x_row, z_row, dy_row, ds_row, dx_row, dz_row, dres_row,   # row strides (elements)
    partials_row,     # (1 + HAS_DB) · d
    HAS_Z: tl.constexpr, HAS_BIAS: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr, IS_RMS: tl.constexpr,
    HAS_DS: tl.constexpr, STORE_DRES: tl.constexpr, HAS_DB: tl.constexpr,
    ROWS: tl.constexpr, GROUPS: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)         # GROUPS groups of one row at a time
    cols = tl.arange(0, BLOCK)
    mask = (groups < G)[:, None] & (cols < group_size)[None, :]
    offs = groups[:, None] * group_size + cols[None, :]                 # (GROUPS, BLOCK) channels
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((GROUPS, BLOCK), dtype=tl.float32)
    db = tl.zeros((GROUPS, BLOCK), dtype=tl.float32)
    first = pid.to(tl.int64) * ROWS
    for i in range(0, tl.minimum(ROWS, M - pid * ROWS)):   # this program's rows in order: the partials' order
        row = first + i
        v = tl.load(x_ptr + row * x_row + offs, mask=mask, other=0.0).to(tl.float32)
        e = tl.load(dy_ptr + row * dy_row + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_Z:
            z = tl.load(z_ptr + row * z_row + offs, mask=mask, other=0.0).to(tl.float32)
            sig = 1.0 / (1.0 + tl.exp(-z))
            gate = z * sig
            dgate = sig * (1.0 + z * (1.0 - sig))                      # silu'(z)
            if not NORM_BEFORE_GATE:
                s = v
                v = v * gate
        rstd = tl.load(rstd_ptr + row * G + groups, mask=groups < G, other=0.0)[:, None]
        if IS_RMS:
            vhat = v * rstd
        else:
            mean = tl.load(mean_ptr + row * G + groups, mask=groups < G, other=0.0)[:, None]
            vhat = tl.where(mask, (v - mean) * rstd, 0.0)
        if HAS_Z and NORM_BEFORE_GATE:   # y = (v̂ w + b) silu(z)
            pre = vhat * w
            if HAS_BIAS:
                pre += b
            tl.store(dz_ptr + row * dz_row + offs, (e * pre * dgate).to(dz_ptr.dtype.element_ty), mask=mask)
            e = e * gate
        dw += e * vhat
        if HAS_DB:
            db += e
        g = e * w
        c1 = tl.reduce(vhat * g, 1, _sum_combine)[:, None] / group_size
        if IS_RMS:
            dv = (g - vhat * c1) * rstd
        else:
            c2 = tl.reduce(g, 1, _sum_combine)[:, None] / group_size
            dv = (g - (vhat * c1 + c2)) * rstd
        if HAS_Z and not NORM_BEFORE_GATE:   # v = s silu(z)
            tl.store(dz_ptr + row * dz_row + offs, (dv * s * dgate).to(dz_ptr.dtype.element_ty), mask=mask)
            dv = dv * gate
        if HAS_DS:
            dv += tl.load(ds_ptr + row * ds_row + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + row * dx_row + offs, dv.to(dx_ptr.dtype.element_ty), mask=mask)
        if STORE_DRES:
            tl.store(dres_ptr + row * dres_row + offs, dv.to(dres_ptr.dtype.element_ty), mask=mask)
    base = partials_ptr + pid.to(tl.int64) * partials_row + offs
    tl.store(base, dw, mask=mask)
    if HAS_DB:
        tl.store(base + G * group_size, db, mask=mask)


def _warps(elements: int) -> int:
    return min(max(elements // 256, 1), 8)


def _fed(t: torch.Tensor | None) -> torch.Tensor | None:
    """t as the kernels take it: its own dtype on a GPU, fp32 on the CPU (compute_dtype); unit stride along d."""
    if t is None:
        return None
    kd = device.compute_dtype(t.dtype, t.device)
    t = t if t.dtype == kd else t.to(kd)
    return t if t.stride(-1) == 1 else t.contiguous()


def _out(shape, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    return torch.empty(shape, device=like.device, dtype=device.compute_dtype(dtype, like.device))


def norm_fwd(x, weight, bias, z, residual, eps: float, group_size: int, norm_before_gate: bool, is_rms_norm: bool,
             *, stream_dtype: torch.dtype | None = None, norm_stored_s: bool = False, store_stats: bool = True):
    """Launch :func:`norm_fwd_kernel` on validated x (M, d), z and residual (M, d) or None, weight, bias (d,).

    ``stream_dtype``: write s = x + residual (x alone without one) in this dtype; None writes no s (then no
    residual). ``norm_stored_s``: normalise s as rounded to ``stream_dtype`` instead of the fp32 sum.
    Returns (y in x's dtype, s or None, μ (M, G) fp32 or None, σ⁻¹ (M, G) fp32 or None); μ and σ⁻¹ with
    ``store_stats`` (μ in LayerNorm mode only)."""
    if residual is not None and stream_dtype is None:
        raise ValueError("a residual needs stream_dtype, the dtype of the sum s written out")
    M, d = x.shape
    G = d // group_size
    xk, zk, rk, wk, bk = (_fed(t) for t in (x, z, residual, weight, bias))
    y = _out((M, d), x.dtype, x)
    s = _out((M, d), stream_dtype, x) if stream_dtype is not None else None
    rstd = torch.empty(M, G, device=x.device, dtype=torch.float32) if store_stats else None
    mean = torch.empty(M, G, device=x.device, dtype=torch.float32) if store_stats and not is_rms_norm else None
    block = triton.next_power_of_2(group_size)
    block_m = min(max(FWD_TILE // block, 1), 64)
    if M:
        norm_fwd_kernel[(triton.cdiv(M * G, block_m),)](
            xk, zk if zk is not None else xk, rk if rk is not None else xk, wk, bk if bk is not None else wk,
            y, s if s is not None else y, mean if mean is not None else y, rstd if rstd is not None else y,
            M, G, group_size,
            xk.stride(0), zk.stride(0) if zk is not None else 0, rk.stride(0) if rk is not None else 0, y.stride(0),
            s.stride(0) if s is not None else 0, float(eps),
            HAS_Z=z is not None, HAS_BIAS=bias is not None, NORM_BEFORE_GATE=bool(norm_before_gate),
            IS_RMS=bool(is_rms_norm), HAS_RESIDUAL=residual is not None, STORE_S=s is not None,
            NORM_STORED_S=bool(norm_stored_s), STORE_STATS=bool(store_stats), BLOCK_M=block_m, BLOCK=block,
            num_warps=_warps(block_m * block),
        )
    y = y.to(x.dtype)
    s = s.to(stream_dtype) if s is not None else None
    return y, s, mean, rstd


def norm_bwd(dy, ds, x, z, weight, bias, mean, rstd, group_size: int, norm_before_gate: bool, is_rms_norm: bool,
             *, dx_dtype: torch.dtype, dres_dtype: torch.dtype | None = None, want_db: bool = False):
    """Launch :func:`norm_bwd_kernel`, then fold the weight's (and bias's) partials with ``sum_partials``.

    x (M, d): the input the forward normalised (x, or the stored s); z, μ, σ⁻¹ as the forward had and saved
    them; dy (M, d); ds (M, d) or None (the gradient of a returned s). ``dres_dtype``: also return the residual's
    gradient in this dtype. Returns (dx in ``dx_dtype``, dz in z's dtype or None, dresidual or None,
    dw (d,) fp32, db (d,) fp32 or None)."""
    M, d = x.shape
    G = d // group_size
    xk, zk, wk, bk, dyk, dsk = (_fed(t) for t in (x, z, weight, bias, dy, ds))
    dx = _out((M, d), dx_dtype, x)
    dz = _out((M, d), z.dtype, x) if z is not None else None
    dres = _out((M, d), dres_dtype, x) if dres_dtype is not None else None
    P = triton.cdiv(M, ROWS_PER_PROGRAM)
    sums = 2 if want_db else 1
    partials = torch.empty(P, sums, d, device=x.device, dtype=torch.float32)
    block = triton.next_power_of_2(group_size)
    groups = min(max(BWD_TILE // block, 1), triton.next_power_of_2(G))
    if M:
        norm_bwd_kernel[(P, triton.cdiv(G, groups))](
            xk, zk if zk is not None else xk, wk, bk if bk is not None else wk,
            mean if mean is not None else rstd, rstd, dyk, dsk if dsk is not None else dyk,
            dx, dz if dz is not None else dx, dres if dres is not None else dx, partials,
            M, G, group_size,
            xk.stride(0), zk.stride(0) if zk is not None else 0, dyk.stride(0), dsk.stride(0) if dsk is not None else 0,
            dx.stride(0), dz.stride(0) if dz is not None else 0, dres.stride(0) if dres is not None else 0, sums * d,
            HAS_Z=z is not None, HAS_BIAS=bias is not None, NORM_BEFORE_GATE=bool(norm_before_gate),
            IS_RMS=bool(is_rms_norm), HAS_DS=ds is not None, STORE_DRES=dres is not None, HAS_DB=bool(want_db),
            ROWS=ROWS_PER_PROGRAM, GROUPS=groups, BLOCK=block, num_warps=_warps(groups * block),
        )
    folded = sum_partials(partials, dim=0) if P else torch.zeros(sums, d, device=x.device)   # (sums, d)
    return (dx.to(dx_dtype), dz.to(z.dtype) if dz is not None else None,
            dres.to(dres_dtype) if dres is not None else None, folded[0], folded[1] if want_db else None)


def gated_norm_fwd(x, weight, bias, z, eps: float, group_size: int, norm_before_gate: bool, is_rms_norm: bool,
                   residual=None):
    """The inference forward (no statistics saved): y (M, d) in x's dtype for x (M, d), z (M, d) or None. With
    ``residual`` (M, d) of x's dtype: the norm of s = residual + x as stored in that dtype, and returns (y, s)."""
    y, s, _, _ = norm_fwd(x, weight, bias, z, residual, eps, group_size, norm_before_gate, is_rms_norm,
                          stream_dtype=None if residual is None else residual.dtype,
                          norm_stored_s=True, store_stats=False)
    return y if residual is None else (y, s)
