"""Mamba-3's decode step as one Triton kernel: one token, every head, the state updated in one pass.

Math (per batch row and head; see :mod:`mambalab.ref.mamba3`, whose :func:`~mambalab.ref.mamba3.mamba3_step_ref`
this kernel is checked against):

    θ'      = θ + angles ⊙ Δ                                    new angle state (a,), stored mod 2π in [0, 2π)
    k̂_r     = Rot(θ') (k_r + k_bias_r),  q̂_r = Rot(θ') (q_r + q_bias_r)
    U_prev  = Σ_r (v_prev ⊙ W^V_r) k_prev,rᵀ,   U = Σ_r (v ⊙ W^V_r) k̂_rᵀ
    H'      = α H + (1 - λ) Δ α U_prev + λ Δ U,   α = exp(AΔ)
    out     = Σ_r W^O_r ⊙ ((H' q̂_r + D v ⊙ W^V_r) ⊙ silu(z ⊙ W^Z_r))     (SISO: no W)

Rot turns the pairs (2i, 2i+1) by θ'_i (i < a): the kernel keeps every n-vector and the state as its even and
odd columns, (BLOCK_P, N/2) tiles, so rotating is elementwise. Rows are read and written whole (contiguous) and
split into their pairs in registers (``tl.reshape`` + ``tl.split``, ``tl.join`` back), as the rotary kernels do,
rather than read at a stride of two (10.0 µs against 41.6: 2026-11-30_h200_mamba3_step_rows_ab.json).
A decode step reads the whole state once and does O(R p n) work on it: it is memory-bound for small R,
which is what MIMO's R > 1 puts to use.

Tile rule (shape only): one program per (batch row, head, block of BLOCK_P head dimensions), the state
dimension whole (BLOCK_N2 = next_pow2(n / 2)). Small p-blocks give a decode step with a small batch enough
programs to fill the GPU. No sum crosses programs (the rotated k̂ and θ' are recomputed by every p-block; the
first writes them). The ranks are a loop, on the state split into its pairs or on its rows as they lie (FLAT:
only k̂ and q̂ are split and joined back); the state may be read and written with evict_first (STREAM: it is
touched once a step).
:func:`step_config` chooses, with BLOCK_P and the warps.

Shapes (contiguous, fp32 on the CPU interpreter): angle (b, h, a), ssm (b, h, p, n), k_prev (b, h, r, n),
v_prev (b, h, p); q, k (b, r, g, n); v, z (b, h, p); adt, dt, trap (b, h); q_bias, k_bias (h, r, n);
angles (b, h, a); D (h,); mimo_v, mimo_z, mimo_o (h, r, p). Outputs: out (b, h, p) in v's dtype; the new
state (angle, ssm, k, v) in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pairs(x_ptr, offs_c, mask_c, BLOCK_N2: tl.constexpr):
    """An n-vector read whole (contiguous) and split in registers: (even, odd) columns, each (BLOCK_N2,) fp32."""
    x = tl.load(x_ptr + offs_c, mask=mask_c, other=0.0).to(tl.float32)
    return tl.split(tl.reshape(x, (BLOCK_N2, 2)))


@triton.jit
def _rotated(x_ptr, bias_ptr, offs_c, mask_c, cos, sin, BLOCK_N2: tl.constexpr):
    """(x + bias) at even and odd columns, turned by θ: returns (even, odd), each (BLOCK_N2,) fp32."""
    x0, x1 = _pairs(x_ptr, offs_c, mask_c, BLOCK_N2)
    b0, b1 = _pairs(bias_ptr, offs_c, mask_c, BLOCK_N2)
    x0 += b0
    x1 += b1
    return x0 * cos - x1 * sin, x0 * sin + x1 * cos


@triton.jit
def mamba3_step_kernel(
    angle_ptr,        # (b, h, a) θ before the step
    ssm_ptr,          # (b, h, p, n) H before the step
    kprev_ptr,        # (b, h, r, n) the previous step's k̂
    vprev_ptr,        # (b, h, p) the previous step's raw v
    q_ptr, k_ptr,     # (b, r, g, n) this step's q and k (normalised, no bias)
    v_ptr,            # (b, h, p)
    adt_ptr, dt_ptr, trap_ptr,   # (b, h) A·Δ, Δ, λ
    qbias_ptr, kbias_ptr,        # (h, r, n)
    angles_ptr,       # (b, h, a) angle rates
    D_ptr,            # (h,) or a dummy
    z_ptr,            # (b, h, p) or a dummy
    wv_ptr, wz_ptr, wo_ptr,      # (h, r, p) MIMO weights, or dummies
    out_ptr,          # (b, h, p) out
    angle_out_ptr,    # (b, h, a) out: θ'
    ssm_out_ptr,      # (b, h, p, n) out: H'
    k_out_ptr,        # (b, h, r, n) out: k̂
    v_out_ptr,        # (b, h, p) out: v
    h, g, p, n, a,    # sizes
    R: tl.constexpr,             # MIMO rank
    MIMO: tl.constexpr,          # the W^V, W^Z, W^O weights are given
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr,
    BLOCK_P: tl.constexpr,       # head dimensions per program
    BLOCK_N2: tl.constexpr,      # n / 2, padded to a power of two
    FLAT: tl.constexpr,          # the rank loop on the state's rows as they lie (no split into pairs)
    STREAM: tl.constexpr,        # the state read and written with evict_first (it is touched once a step)
):
    pid_b = tl.program_id(0)
    pid_h = tl.program_id(1)
    pid_p = tl.program_id(2)
    bh = pid_b * h + pid_h
    grp = pid_h // (h // g)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_i = tl.arange(0, BLOCK_N2)                                # pair index: columns 2i and 2i+1
    offs_c = tl.arange(0, 2 * BLOCK_N2)                            # columns, read and written whole
    mask_p = offs_p < p
    mask_c = offs_c < 2 * (n // 2)
    mask_pc = mask_p[:, None] & mask_c[None, :]

    dt = tl.load(dt_ptr + bh).to(tl.float32)
    alpha = tl.exp(tl.load(adt_ptr + bh).to(tl.float32))
    lam = tl.load(trap_ptr + bh).to(tl.float32)
    mask_a = offs_i < a                                            # pairs past a: θ = 0, no turn
    theta = tl.load(angle_ptr + bh * a + offs_i, mask=mask_a, other=0.0).to(tl.float32)
    theta += tl.load(angles_ptr + bh * a + offs_i, mask=mask_a, other=0.0).to(tl.float32) * dt
    cos = tl.cos(theta)
    sin = tl.sin(theta)

    # the state's rows read whole, then (but with FLAT) split into even and odd columns, (BLOCK_P, BLOCK_N2) each
    s_ptrs = (bh.to(tl.int64) * p + offs_p[:, None]) * n + offs_c[None, :]
    if STREAM:
        S = tl.load(ssm_ptr + s_ptrs, mask=mask_pc, other=0.0, eviction_policy="evict_first").to(tl.float32)
    else:
        S = tl.load(ssm_ptr + s_ptrs, mask=mask_pc, other=0.0).to(tl.float32)
    if FLAT:
        # the state's rows as they lie, (BLOCK_P, 2·BLOCK_N2): only the n-vectors are split into pairs, to
        # turn them, and joined back (k̂ and q̂ in the state's column order); no split or join of the state
        S = S * alpha
    else:
        S0, S1 = tl.split(tl.reshape(S, (BLOCK_P, BLOCK_N2, 2)))
        S0 *= alpha
        S1 *= alpha
    v_prev = tl.load(vprev_ptr + bh * p + offs_p, mask=mask_p, other=0.0).to(tl.float32)
    v_now = tl.load(v_ptr + bh * p + offs_p, mask=mask_p, other=0.0).to(tl.float32)
    beta = (1.0 - lam) * dt * alpha
    gamma = lam * dt
    if HAS_D:
        Dh = tl.load(D_ptr + pid_h).to(tl.float32)
    if HAS_Z:
        z = tl.load(z_ptr + bh * p + offs_p, mask=mask_p, other=0.0).to(tl.float32)
    for r in tl.static_range(R):
        wv = 1.0
        if MIMO:
            wv = tl.load(wv_ptr + (pid_h * R + r) * p + offs_p, mask=mask_p, other=0.0).to(tl.float32)
        vp = (beta * v_prev * wv)[:, None]                  # β U_prev: the previous step's input, rank r
        vn = (gamma * v_now * wv)[:, None]                   # γ U: this step's input, rank r
        k0, k1 = _rotated(k_ptr + ((pid_b * R + r) * g + grp) * n, kbias_ptr + (pid_h * R + r) * n,
                          offs_c, mask_c, cos, sin, BLOCK_N2)
        kn = tl.reshape(tl.join(k0, k1), (2 * BLOCK_N2,))
        if FLAT:
            kp = tl.load(kprev_ptr + (bh * R + r) * n + offs_c, mask=mask_c, other=0.0).to(tl.float32)
            S += vp * kp[None, :]
            S += vn * kn[None, :]
        else:
            kp0, kp1 = _pairs(kprev_ptr + (bh * R + r) * n, offs_c, mask_c, BLOCK_N2)
            S0 += vp * kp0[None, :]
            S1 += vp * kp1[None, :]
            S0 += vn * k0[None, :]
            S1 += vn * k1[None, :]
        if pid_p == 0:
            tl.store(k_out_ptr + (bh * R + r) * n + offs_c, kn, mask=mask_c)
    if FLAT:
        S_new = S
    else:
        S_new = tl.reshape(tl.join(S0, S1), (BLOCK_P, 2 * BLOCK_N2))
    if STREAM:
        tl.store(ssm_out_ptr + s_ptrs, S_new, mask=mask_pc, eviction_policy="evict_first")
    else:
        tl.store(ssm_out_ptr + s_ptrs, S_new, mask=mask_pc)
    tl.store(v_out_ptr + bh * p + offs_p, v_now, mask=mask_p)
    if pid_p == 0:
        two_pi = 6.283185307179586                                   # θ' kept in [0, 2π), as mamba-ssm
        tl.store(angle_out_ptr + bh * a + offs_i, theta - two_pi * tl.floor(theta / two_pi), mask=mask_a)
    out = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for r in tl.static_range(R):
        q0, q1 = _rotated(q_ptr + ((pid_b * R + r) * g + grp) * n, qbias_ptr + (pid_h * R + r) * n,
                          offs_c, mask_c, cos, sin, BLOCK_N2)
        if FLAT:
            y = tl.sum(S * tl.reshape(tl.join(q0, q1), (2 * BLOCK_N2,))[None, :], axis=1)   # H' q̂_r
        else:
            y = tl.sum(S0 * q0[None, :] + S1 * q1[None, :], axis=1)    # (BLOCK_P,): H' q̂_r
        if MIMO:
            wrow = (pid_h * R + r) * p + offs_p
            if HAS_D:
                y += Dh * v_now * tl.load(wv_ptr + wrow, mask=mask_p, other=0.0).to(tl.float32)
            if HAS_Z:
                zr = z * tl.load(wz_ptr + wrow, mask=mask_p, other=0.0).to(tl.float32)
                y = y * zr * tl.sigmoid(zr)
            out += y * tl.load(wo_ptr + wrow, mask=mask_p, other=0.0).to(tl.float32)
        else:
            if HAS_D:
                y += Dh * v_now
            if HAS_Z:
                y = y * z * tl.sigmoid(z)
            out += y
    tl.store(out_ptr + bh * p + offs_p, out.to(out_ptr.dtype.element_ty), mask=mask_p)


def step_config(b: int, h: int, p: int, r: int) -> dict:
    """The launch's tile choices (shape only). r = 1: BLOCK_P = min(16, next_pow2(p)), 2 warps, the rank loop
    on the state split into pairs. r >= 2: BLOCK_P = min(8, next_pow2(p)), 1 warp, the state streamed past the
    caches (STREAM), and at r = 2 the loop on the state's rows as they lie (FLAT).

    Batch 64, h32 p64 n128, r = 4: 72.5 µs against 111.9 at r = 1's (2026-12-03_h200_mamba3_step_sweep_flat.json).
    """
    if r == 1:
        return dict(BLOCK_P=min(16, triton.next_power_of_2(p)), num_warps=2, FLAT=False, STREAM=False)
    return dict(BLOCK_P=min(8, triton.next_power_of_2(p)), num_warps=1, FLAT=r == 2, STREAM=True)


def mamba3_step_fwd(angle, ssm, k_prev, v_prev, q, k, v, adt, dt, trap, q_bias, k_bias, angles, D=None, z=None,
                    mimo_v=None, mimo_z=None, mimo_o=None):
    """Launch the step on validated, contiguous tensors (module docstring). Returns
    (out (b, h, p) in v's dtype, angle', ssm', k̂, v') with the state in fp32."""
    b, h, p = v.shape
    r, g, n = q.shape[1], q.shape[2], q.shape[3]
    a = angle.shape[2]
    f32 = dict(device=v.device, dtype=torch.float32)
    out = torch.empty_like(v)
    angle_out = torch.empty(b, h, a, **f32)
    ssm_out = torch.empty(b, h, p, n, **f32)
    k_out = torch.empty(b, h, r, n, **f32)
    v_out = torch.empty(b, h, p, **f32)
    mimo = mimo_v is not None
    if mimo and mimo_z is None:   # no gate weights without a gate: a dummy, never read (HAS_Z is False)
        mimo_z = mimo_v
    config = step_config(b, h, p, r)
    grid = (b, h, triton.cdiv(p, config["BLOCK_P"]))
    mamba3_step_kernel[grid](
        angle, ssm, k_prev, v_prev, q, k, v, adt, dt, trap, q_bias, k_bias, angles,
        D if D is not None else dt, z if z is not None else v,
        mimo_v if mimo else v, mimo_z if mimo else v, mimo_o if mimo else v,
        out, angle_out, ssm_out, k_out, v_out,
        h, g, p, n, a,
        R=r, MIMO=mimo, HAS_D=D is not None, HAS_Z=z is not None,
        BLOCK_N2=triton.next_power_of_2(max(n // 2, 1)), **config,
    )
    return out, angle_out, ssm_out, k_out, v_out
