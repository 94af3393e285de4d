"""mambalab.modules.Mamba3: decoding step by step equals the full forward (SISO and MIMO, from zero and after a
prefill), the Triton and reference backends agree in outputs and gradients, every parameter learns, the
parameter count is about 6 d_model², state dicts interchange with mamba-ssm's Mamba3, bad arguments fail
clearly, a MIMO block rotates the pairs mamba-ssm's MIMO rotates, is_outproj_norm normalises as mamba-ssm's
norm does. On a GPU: mamba-ssm's Mamba3 computes what ours
does, SISO (its Triton kernel) and MIMO (its TileLang kernels, where TileLang is installed)."""
import pytest
import torch

from conftest import KERNEL_DEVICE, requires_gpu, rotate_halves
from mambalab import oracle
from mambalab.modules import Mamba3
from mambalab.ref import mamba3 as ref

# Tiny shapes: the Triton backend runs in the interpreter on a CPU. d_inner = 32 → h = 4 heads of p = 8.
D_MODEL, D_STATE, HEADDIM, NGROUPS = 16, 8, 8, 2
# Triton against the reference, relative to the output's scale: fp32 on the interpreter, TF32 dots on a GPU.
KERNEL_TOL = 5e-3 if KERNEL_DEVICE == "cuda" else 1e-4


def make(is_mimo=False, rank=2, backend="reference", dtype=torch.float64, seed=0, **kw):
    torch.manual_seed(seed)
    chunk = 16 // (rank if is_mimo else 1)  # the kernels need chunk_size · r >= 16
    m = Mamba3(D_MODEL, d_state=D_STATE, headdim=HEADDIM, ngroups=NGROUPS, is_mimo=is_mimo, mimo_rank=rank,
               chunk_size=kw.pop("chunk_size", chunk), backend=backend, **kw).to(dtype)
    with torch.no_grad():  # move every parameter off its initial value, so each one shows in the comparisons
        for name, p in m.named_parameters():
            p.add_(0.1 * torch.randn_like(p))
    return m


def inputs(b=2, l=13, dtype=torch.float64, seed=1):
    return torch.randn(b, l, D_MODEL, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def decode(m, u, state):
    outs = []
    with torch.no_grad():
        for t in range(u.shape[1]):
            o, state = m.step(u[:, t:t + 1], state)
            outs.append(o)
    return torch.cat(outs, dim=1), state


@pytest.mark.parametrize("is_mimo", [False, True], ids=["siso", "mimo"])
def test_step_by_step_decoding_equals_forward(is_mimo):
    m = make(is_mimo)
    u = inputs()
    with torch.no_grad():
        y, final = m(u, return_final_state=True)
    y_steps, state = decode(m, u, m.zero_state(u.shape[0]))
    torch.testing.assert_close(y_steps, y, atol=1e-12, rtol=1e-10)
    for name in final._fields:
        torch.testing.assert_close(getattr(state, name), getattr(final, name), atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("is_mimo", [False, True], ids=["siso", "mimo"])
def test_prefill_then_decode_equals_forward(is_mimo):
    m = make(is_mimo, dtype=torch.float32)
    u = inputs(l=11, dtype=torch.float32)
    with torch.no_grad():
        y = m(u)
        y_pre, state = m(u[:, :6], return_final_state=True)
    y_steps, _ = decode(m, u[:, 6:], state)
    torch.testing.assert_close(torch.cat([y_pre, y_steps], dim=1), y, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("is_mimo", [False, True], ids=["siso", "mimo"])
def test_triton_backend_matches_reference_forward_backward_and_step(is_mimo):
    ref = make(is_mimo, dtype=torch.float32).to(KERNEL_DEVICE)
    tri = make(is_mimo, dtype=torch.float32, backend="triton").to(KERNEL_DEVICE)
    u = inputs(b=1, l=12, dtype=torch.float32).to(KERNEL_DEVICE)
    (y_ref := ref(u)).square().sum().backward()
    (y_tri := tri(u)).square().sum().backward()
    tol = lambda want: dict(atol=KERNEL_TOL * want.abs().max().item(), rtol=10 * KERNEL_TOL)
    torch.testing.assert_close(y_tri, y_ref, **tol(y_ref))
    for (name, p_ref), p_tri in zip(ref.named_parameters(), tri.parameters()):
        torch.testing.assert_close(p_tri.grad, p_ref.grad, **tol(p_ref.grad), msg=lambda m: f"{name}: {m}")
    y_steps, _ = decode(tri, u[:, :4], tri.zero_state(1))
    torch.testing.assert_close(y_steps, y_ref[:, :4].detach(), **tol(y_ref))


@pytest.mark.parametrize("is_mimo", [False, True], ids=["siso", "mimo"])
def test_every_parameter_gets_a_gradient(is_mimo):
    m = make(is_mimo, dtype=torch.float32)
    m(inputs(dtype=torch.float32)).square().mean().backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().max() > 0, f"{name} gets no gradient"
    # The rows of in_proj that make the rotary angles learn too (the rotation reaches the output).
    angle_rows = m.in_proj.weight.grad[-m.num_rope_angles:]
    assert angle_rows.abs().max() > 0


def test_rope_fraction_zero_is_the_rotary_model_with_its_angles_zeroed():
    """rope_fraction = 0 drops the angle columns of in_proj; it computes what a rotary block does whose angle
    projections are zero (θ stays 0, the rotation is the identity): a real-valued state."""
    rotary = make(dtype=torch.float64)
    real = make(dtype=torch.float64, rope_fraction=0.0)
    a = rotary.num_rope_angles
    assert real.num_rope_angles == 0 and real.in_proj.out_features == rotary.in_proj.out_features - a
    state = dict(rotary.state_dict())
    state["in_proj.weight"] = state["in_proj.weight"][:-a]
    real.load_state_dict(state)
    u = inputs()
    with torch.no_grad():
        rotary.in_proj.weight[-a:] = 0
        torch.testing.assert_close(real(u), rotary(u), atol=1e-12, rtol=1e-10)
        rotary.in_proj.weight[-a:] = 1  # and the angles do change the output
        assert (real(u) - rotary(u)).abs().max() > 1e-3


def test_mimo_block_rotates_the_pairs_mamba_ssm_mimo_rotates(monkeypatch):
    """mamba-ssm's MIMO turns the pairs (i, i + n/2) of q and k where its SISO (and our kernels) turn (2i, 2i+1).
    A MIMO block computes the former: its scan, handed q, k and their biases in the natural n order and run
    with the (i, i + n/2) rotation written out (conftest.rotate_halves), gives the block's output."""
    m = make(is_mimo=True, rope_fraction=1.0)   # a = n/2: every pair turns
    u = inputs()
    with torch.no_grad():
        y = m(u)
        scan = m.scan_inputs(m.in_proj(u))
        natural = torch.argsort(m.pair_order(u.device))
        for name in ("q", "k", "q_bias", "k_bias"):
            scan[name] = scan[name][..., natural]
        adjacent = m.out_proj(ref.mamba3_recurrent(**scan).flatten(-2))
        monkeypatch.setattr(ref, "rotate_pairs", rotate_halves)
        halves = m.out_proj(ref.mamba3_recurrent(**scan).flatten(-2))
    torch.testing.assert_close(halves, y, atol=1e-12, rtol=1e-10)
    assert (adjacent - y).abs().max() > 1e-3 * y.abs().max()   # the layout matters


def test_outproj_norm_normalises_each_head_then_gates_as_mamba_ssm_s_norm():
    """is_outproj_norm: the scan runs without z, then mamba-ssm's gated RMSNorm (its reference rms_norm_ref)
    normalises each head's p channels and gates by silu(z) after: y = rmsnorm_head(y) ⊙ w ⊙ silu(z)."""
    m = make(is_outproj_norm=True)
    u = inputs()
    rms_norm_ref = oracle.module("ops.triton.layernorm_gated").rms_norm_ref
    with torch.no_grad():
        m.norm.weight.copy_(m.norm.weight.float())   # representable in fp32: the reference casts the weight to fp32
        projected = m.in_proj(u)
        scan = m.scan_inputs(projected)
        assert scan["z"] is None
        y = ref.mamba3_recurrent(**scan).flatten(-2)
        z = projected[..., :m.d_inner]
        want = m.out_proj(rms_norm_ref(y, m.norm.weight, None, z=z, eps=1e-5, group_size=HEADDIM,
                                       norm_before_gate=True, upcast=False))
        torch.testing.assert_close(m(u), want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("is_mimo", [False, True], ids=["siso", "mimo"])
def test_block_built_on_meta_then_materialised_computes_the_same(is_mimo):
    """Built on the meta device, materialised with to_empty and loaded from a state dict (how large models are
    built): nothing the block computes with may live outside its state dict (a buffer, such as MIMO's
    permutation of n would be, is left uninitialised by to_empty)."""
    m = make(is_mimo)
    lazy = Mamba3(D_MODEL, d_state=D_STATE, headdim=HEADDIM, ngroups=NGROUPS, is_mimo=is_mimo, mimo_rank=2,
                  chunk_size=m.chunk_size, backend="reference", device="meta").to_empty(device="cpu").double()
    lazy.load_state_dict(m.state_dict())
    u = inputs()
    with torch.no_grad():
        torch.testing.assert_close(lazy(u), m(u), atol=0, rtol=0)


@pytest.mark.parametrize("d_model", [768, 2048])
@pytest.mark.parametrize("is_mimo", [False, True], ids=["siso", "mimo"])
def test_parameter_count_is_about_six_d_model_squared(d_model, is_mimo):
    m = Mamba3(d_model, is_mimo=is_mimo, device="meta")  # defaults: d_state 128, expand 2, headdim 64
    count = sum(p.numel() for p in m.parameters())
    h, r, a = m.nheads, m.mimo_rank, m.num_rope_angles
    # in_proj: z and x (2 · 2 d_model), B and C (2 r n), dd_dt, dd_A, trap (3 h) and the angles (a); out_proj
    in_cols = 4 * d_model + 2 * r * 128 + 3 * h + a
    small = 2 * h + 2 * h * r * 128 + 2 * 128 + (3 * h * r * 64 if is_mimo else 0)
    assert count == d_model * in_cols + 2 * d_model * d_model + small
    # SISO: within 8% of 6 d_model². MIMO's rank-4 B and C add 2 (r - 1) n columns: within 30%.
    assert 1.0 < count / (6 * d_model ** 2) < (1.3 if is_mimo else 1.08)


@pytest.mark.parametrize("is_mimo, is_outproj_norm", [(False, False), (True, False), (False, True)],
                         ids=["siso", "mimo", "siso-outproj-norm"])
def test_state_dict_interchanges_with_mamba_ssm(is_mimo, is_outproj_norm):
    upstream = oracle.module("modules.mamba3").Mamba3
    kw = dict(d_state=16, headdim=16, ngroups=2, is_mimo=is_mimo, mimo_rank=4, is_outproj_norm=is_outproj_norm,
              device="meta")
    try:
        theirs = upstream(64, **kw)
    except AssertionError as err:  # its MIMO needs TileLang kernels
        pytest.skip(f"mamba-ssm's Mamba3 cannot be built here: {err}")
    ours = Mamba3(64, **kw)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}


def test_low_precision_keeps_the_sensitive_parameters_in_fp32():
    m = make(dtype=torch.bfloat16)
    assert {n for n, p in m.named_parameters() if p.dtype == torch.float32} == {"dt_bias", "D", "B_bias", "C_bias"}
    out = m(inputs(l=4, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


@pytest.mark.parametrize("kwargs, message", [
    (dict(headdim=24), "headdim = 24 must divide d_inner"),
    (dict(ngroups=3), "ngroups = 3 must divide nheads"),
    (dict(rope_fraction=1.5), "rope_fraction must lie in [0, 1]"),
    (dict(rope_fraction=-0.1), "rope_fraction must lie in [0, 1]"),
    (dict(rope_fraction=0.1), "rotates no pair"),
    (dict(is_mimo=True, mimo_rank=3), "mimo_rank must be one of (1, 2, 4, 8)"),
    (dict(backend="cuda"), "backend must be one of"),
    (dict(dt_min=0.1, dt_max=0.01), "dt_min <= dt_max"),
])
def test_bad_constructor_arguments_fail_clearly(kwargs, message):
    args = dict(d_model=D_MODEL, d_state=D_STATE, headdim=HEADDIM, ngroups=NGROUPS) | kwargs
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        Mamba3(**args)


def test_bad_inputs_fail_clearly():
    m = make()
    with pytest.raises(ValueError, match="u must have shape"):
        m(torch.randn(2, 5, D_MODEL + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="step takes one token"):
        m.step(inputs(l=2), m.zero_state(2))


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype, is_mimo, is_outproj_norm",
                         [(torch.float32, False, False), (torch.bfloat16, False, False), (torch.bfloat16, True, False),
                          (torch.float32, False, True)],
                         ids=["siso-fp32", "siso-bf16", "mimo4-bf16", "siso-outproj-norm-fp32"])
def test_matches_mamba_ssm_mamba3_on_gpu(dtype, is_mimo, is_outproj_norm):
    """mamba-ssm's Mamba3 loaded with our weights: SISO on its Triton kernel mamba3_siso_combined, MIMO r = 4
    on its TileLang kernels (skipped without TileLang; its MIMO rotates the pairs (i, i + n/2), which our block
    matches by permuting n, and the weights here are moved off their initial values so that a rank or a pair
    mixed up shows). Its kernels use a fast tanh approximation and bf16/tf32 products, hence the tolerance: 2%
    of the output's scale. The shape is tests/test_mamba3_kernels.py's MIMO comparison's, so that TileLang
    compiles its kernels once for both."""
    if is_mimo:
        pytest.importorskip("tilelang", reason="mamba-ssm's MIMO kernels need TileLang (tilelang==0.1.8)")
    kw = dict(d_state=128, headdim=64, is_mimo=is_mimo, mimo_rank=4, chunk_size=16 if is_mimo else 64,
              is_outproj_norm=is_outproj_norm, device="cuda", dtype=dtype)
    theirs = oracle.module("modules.mamba3").Mamba3(256, **kw)
    ours = Mamba3(256, **kw)
    with torch.no_grad():
        for param in theirs.parameters():
            param.mul_(1 + 0.1 * torch.randn_like(param))
    ours.load_state_dict(theirs.state_dict())
    u = torch.randn(2, 256, 256, device="cuda", dtype=dtype)
    with torch.no_grad(), oracle.single_config("mamba_ssm.ops.triton.mamba3"):   # no minutes of autotuning
        y_theirs, y_ours = theirs(u).float(), ours(u).float()
    assert (y_ours - y_theirs).abs().max() <= 0.02 * y_theirs.abs().max()
