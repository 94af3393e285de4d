"""Mamba1, Mamba2 and Mamba3 called as mamba-ssm's blocks are called.

* Signatures: every argument of mamba-ssm's constructors, ``forward``, ``step`` and ``allocate_inference_cache``
  is accepted, in mamba-ssm's order with its defaults; mambalab's own arguments are keyword-only after them.
* Arguments that cannot be honoured fail naming themselves (``process_group``, ``dropout``, Mamba3's ``seq_idx``
  and ``cu_seqlens``); ones that change nothing (``use_fast_path``, ``use_mem_eff_path``, ``use_tilelang``) are taken.
* Decoding with mamba-ssm's own ``InferenceParams`` (prefill at ``seqlen_offset == 0``, then one token per call):
  Mamba1 and Mamba2 against mamba-ssm's blocks loaded with the same weights, run the same way on the CPU (their
  pure-PyTorch paths: its scan reference in place of its CUDA/Triton scans); Mamba3, whose step mamba-ssm runs
  only on a GPU, against our own full forward. The cache tuples have mamba-ssm's shapes.
* Mamba2's d_ssm (gated MLP beside the SSD), D_has_hdim and conv_init against mamba-ssm's Mamba2; l = 0;
  a float64 block; mamba-ssm's flattened ``seqlen`` form.
"""
import inspect
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import FP32_KERNEL_TOL, KERNEL_DEVICE
from mambalab import oracle
from mambalab.modules import Mamba1, Mamba2, Mamba3

D_MODEL = 16


def InferenceParams(**kw):
    return oracle.module("utils.generation").InferenceParams(**kw)


def positional(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()
            if p.kind is p.POSITIONAL_OR_KEYWORD]


def upstream_class(name):
    module, cls = {"Mamba1": ("modules.mamba_simple", "Mamba"), "Mamba2": ("modules.mamba2", "Mamba2"),
                   "Mamba3": ("modules.mamba3", "Mamba3")}[name]
    return getattr(oracle.module(module), cls)


# ---------------------------------------------------------------------------------------------- signatures
@pytest.mark.parametrize("ours", [Mamba1, Mamba2, Mamba3], ids=lambda c: c.__name__)
@pytest.mark.parametrize("method", ["__init__", "forward", "step", "allocate_inference_cache"])
def test_signatures_are_mamba_ssm_s_with_mambalab_extras_keyword_only(ours, method):
    theirs = upstream_class(ours.__name__)
    ours_fn, theirs_fn = getattr(ours, method), getattr(theirs, method)
    if ours is Mamba3 and method == "step":
        # two forms, step(u, state) and mamba-ssm's step(u, angle_state, ssm_state, k_state, v_state): *state
        params = inspect.signature(ours_fn).parameters
        assert [p.kind for p in params.values()][1:] == [inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                        inspect.Parameter.VAR_POSITIONAL,
                                                        inspect.Parameter.VAR_KEYWORD]
        return
    mine, upstream = positional(ours_fn), positional(theirs_fn)
    assert [name for name, _ in mine] == [name for name, _ in upstream]             # names and order
    for (name, default), (_, expected) in zip(mine, upstream):
        if expected is not inspect.Parameter.empty:   # where mamba-ssm requires one (max_seqlen), ours may default
            assert default == expected, f"{name}: default {default!r}, mamba-ssm's {expected!r}"
    kinds = {p.kind for p in inspect.signature(ours_fn).parameters.values()
             if p.kind is not p.POSITIONAL_OR_KEYWORD}
    assert kinds <= {inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.VAR_KEYWORD}
    takes_kwargs = lambda fn: any(p.kind is p.VAR_KEYWORD for p in inspect.signature(fn).parameters.values())
    assert takes_kwargs(ours_fn) == takes_kwargs(theirs_fn)


def test_arguments_that_change_nothing_are_accepted():
    assert Mamba1(D_MODEL, use_fast_path=False, layer_idx=3).layer_idx == 3
    m2 = Mamba2(D_MODEL, d_state=8, headdim=8, use_mem_eff_path=False, layer_idx=1, sequence_parallel=False)
    assert m2.layer_idx == 1 and not m2.use_mem_eff_path
    m3 = Mamba3(D_MODEL, d_state=8, headdim=8, layer_idx=2, n_layer=4, use_tilelang=True, backend="reference")
    assert m3.layer_idx == 2 and m3.ignored_kwargs == {"use_tilelang": True}


def test_arguments_that_cannot_be_honoured_fail_naming_themselves():
    with pytest.raises(ValueError, match="process_group.*TensorParallelMamba2"):
        Mamba2(D_MODEL, d_state=8, headdim=8, process_group=object())
    with pytest.raises(ValueError, match="dropout"):
        Mamba3(D_MODEL, d_state=8, headdim=8, dropout=0.1)
    with pytest.raises(NotImplementedError, match="is_outproj_norm with is_mimo"):
        Mamba3(D_MODEL, d_state=8, headdim=8, is_outproj_norm=True, is_mimo=True, mimo_rank=2)
    m2 = Mamba2(D_MODEL, d_state=8, headdim=8, scan="reference")
    m3 = Mamba3(D_MODEL, d_state=8, headdim=8, backend="reference")
    u = torch.randn(1, 4, D_MODEL)
    with pytest.raises(NotImplementedError, match="seq_idx"):
        m3(u, seq_idx=torch.zeros(1, 4, dtype=torch.int32))
    # both blocks take packed sequences (tests/test_ssd_varlen.py, tests/test_mamba3_varlen_ours.py) and name bad ones
    with pytest.raises(ValueError, match="cu_seqlens"):
        m3(u, cu_seqlens=torch.tensor([0, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="seq_idx"):
        m2(u, seq_idx=torch.zeros(1, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens"):
        m2(u, cu_seqlens=torch.tensor([0, 5], dtype=torch.int32))
    for block in (Mamba1(D_MODEL), m2, m3):
        with pytest.raises(ValueError, match="layer_idx"):
            block(u, inference_params=InferenceParams(max_seqlen=8, max_batch_size=1))


# ---------------------------------------------------------------------------------------------- mamba-ssm on the CPU
def chunk_scan_on_selective_scan_ref(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None,
                                     seq_idx=None, cu_seqlens=None, dt_softplus=False, dt_limit=(0.0, float("inf")),
                                     return_final_states=False, return_varlen_states=False):
    """mamba_chunk_scan_combined's arguments, computed by mamba-ssm's pure-PyTorch ``selective_scan_ref``: SSD is
    the selective scan with one decay per head (A repeated over the head's p channels and n columns) and B, C
    shared by the channels of a group. Lets mamba-ssm's Mamba2 run its prefill on the CPU."""
    assert initial_states is None and seq_idx is None and cu_seqlens is None and not return_varlen_states
    b, l, h, p = x.shape
    n = B.shape[-1]
    delta = dt.float() + (dt_bias.float() if dt_bias is not None else 0)
    delta = (F.softplus(delta) if dt_softplus else delta).clamp(*dt_limit)            # (b, l, h)
    channels = lambda t: t.permute(0, 2, 3, 1).reshape(b, h * p, l)                   # (b, l, h, p) -> (b, hp, l)
    skip = None if D is None else (D.reshape(h * p) if D.dim() == 2 else D.repeat_interleave(p))
    out, last = oracle.selective_scan_ref()(
        channels(x), delta.repeat_interleave(p, dim=-1).transpose(1, 2), A.float().repeat_interleave(p)[:, None]
        .expand(h * p, n), B.permute(0, 2, 3, 1), C.permute(0, 2, 3, 1), skip,
        None if z is None else channels(z), return_last_state=True)
    y = out.reshape(b, h, p, l).permute(0, 3, 1, 2)                                  # (b, l, h, p)
    return (y, last.reshape(b, h, p, n)) if return_final_states else y


@pytest.fixture
def mamba_ssm_on_cpu(monkeypatch):
    """mamba-ssm's Mamba and Mamba2 modules with their CUDA/Triton-only calls pointed at mamba-ssm's own
    pure-PyTorch references: its selective_scan_ref, its rms_norm_ref, and its PyTorch step paths."""
    simple, mamba2 = oracle.module("modules.mamba_simple"), oracle.module("modules.mamba2")
    norm = oracle.module("ops.triton.layernorm_gated")
    monkeypatch.setattr(simple, "selective_scan_fn", oracle.selective_scan_ref())
    for module in (simple, mamba2):
        monkeypatch.setattr(module, "causal_conv1d_fn", None)
        monkeypatch.setattr(module, "causal_conv1d_update", None)
        monkeypatch.setattr(module, "selective_state_update", None)
    monkeypatch.setattr(mamba2, "mamba_chunk_scan_combined", chunk_scan_on_selective_scan_ref)
    monkeypatch.setattr(norm, "rmsnorm_fn", lambda x, weight, bias, z=None, eps=1e-6, group_size=None,
                        norm_before_gate=True: norm.rms_norm_ref(x, weight, bias, z=z, eps=eps, group_size=group_size,
                                                                 norm_before_gate=norm_before_gate))
    return simple, mamba2


def perturbed(block, seed=0):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # move every parameter off its initial value, so each one shows in the comparisons
        for p in block.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return block


def generate(block, u, prefill, layer_idx):
    """Drive ``block`` as mamba-ssm's generation loop does: one forward on u[:, :prefill] at seqlen_offset 0, then
    one token per forward with seqlen_offset advanced. Returns the outputs (b, l, d_model) and the cache."""
    params = InferenceParams(max_seqlen=u.shape[1], max_batch_size=u.shape[0])
    outs = [block(u[:, :prefill], inference_params=params)]
    params.seqlen_offset += prefill
    for t in range(prefill, u.shape[1]):
        outs.append(block(u[:, t:t + 1], inference_params=params))
        params.seqlen_offset += 1
    return torch.cat(outs, dim=1), params.key_value_memory_dict[layer_idx]


def test_mamba1_decodes_with_inference_params_as_mamba_ssm_s_mamba(mamba_ssm_on_cpu):
    """Ours runs its scan kernel (on the GPU if there is one); mamba-ssm's runs its PyTorch paths on the CPU."""
    simple, _ = mamba_ssm_on_cpu
    torch.manual_seed(0)
    ours = perturbed(Mamba1(D_MODEL, d_state=4, layer_idx=0))
    theirs = simple.Mamba(D_MODEL, d_state=4, use_fast_path=False, layer_idx=0)
    theirs.load_state_dict(ours.state_dict())
    ours.to(KERNEL_DEVICE)
    u = torch.randn(2, 9, D_MODEL, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y_ours, cache_ours = generate(ours, u.to(KERNEL_DEVICE), prefill=5, layer_idx=0)
        y_theirs, cache_theirs = generate(theirs, u, prefill=5, layer_idx=0)
        whole = ours(u.to(KERNEL_DEVICE))
    torch.testing.assert_close(y_ours.cpu(), y_theirs, **FP32_KERNEL_TOL)
    torch.testing.assert_close(y_ours, whole, **FP32_KERNEL_TOL)
    for a, b in zip(cache_ours, cache_theirs):
        torch.testing.assert_close(a.cpu(), b, **FP32_KERNEL_TOL)
    mine = ours.allocate_inference_cache(2, 9)
    assert [t.shape for t in mine] == [t.shape for t in theirs.allocate_inference_cache(2, 9)]


@pytest.mark.parametrize("kw", [dict(), dict(d_ssm=16, D_has_hdim=True), dict(rmsnorm=False, D_has_hdim=True),
                                dict(d_ssm=24, rmsnorm=False, conv_init=0.5)],
                         ids=["default", "d_ssm-D_has_hdim", "no-rmsnorm-D_has_hdim", "d_ssm-no-rmsnorm-conv_init"])
def test_mamba2_forward_and_inference_params_decoding_match_mamba_ssm_s_mamba2(mamba_ssm_on_cpu, kw):
    """ngroups = 1: mamba-ssm's PyTorch step supports no more."""
    _, mamba2 = mamba_ssm_on_cpu
    sizes = dict(d_state=8, headdim=8, chunk_size=8, layer_idx=0, **kw)
    torch.manual_seed(0)
    ours = perturbed(Mamba2(D_MODEL, scan="reference", **sizes))
    theirs = mamba2.Mamba2(D_MODEL, use_mem_eff_path=False, **sizes)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    theirs.load_state_dict(ours.state_dict())
    u = torch.randn(2, 11, D_MODEL, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = ours(u)
        torch.testing.assert_close(whole, theirs(u), atol=1e-5, rtol=1e-4)
        y_ours, cache_ours = generate(ours, u, prefill=6, layer_idx=0)
    torch.testing.assert_close(y_ours, whole, atol=1e-5, rtol=1e-4)
    if not kw.get("D_has_hdim"):  # mamba-ssm's PyTorch step reshapes D as (h,) only
        with torch.no_grad():
            y_theirs, cache_theirs = generate(theirs, u, prefill=6, layer_idx=0)
        torch.testing.assert_close(y_ours, y_theirs, atol=1e-5, rtol=1e-4)
        for a, b in zip(cache_ours, cache_theirs):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
        # a state handed over: mamba-ssm prefills (its cache layout: a transposed conv_state), ours decodes
        params = InferenceParams(max_seqlen=11, max_batch_size=2)
        first = theirs(u[:, :6], inference_params=params)
        handed = params.key_value_memory_dict[0]
        with torch.no_grad():
            rest = [ours.step(u[:, t:t + 1], *handed)[0] for t in range(6, 11)]
        torch.testing.assert_close(torch.cat([first, *rest], dim=1), whole, atol=1e-5, rtol=1e-4)
    assert [t.shape for t in ours.allocate_inference_cache(2, 11)] == \
        [t.shape for t in theirs.allocate_inference_cache(2, 11)]
    if "conv_init" in kw:
        fresh = Mamba2(D_MODEL, **sizes)
        assert fresh.conv1d.weight.abs().max() <= kw["conv_init"]


@pytest.mark.parametrize("is_mimo, is_outproj_norm", [(False, False), (True, False), (False, True)],
                         ids=["siso", "mimo", "siso-outproj-norm"])   # is_outproj_norm is SISO only
def test_mamba3_decodes_with_inference_params_as_its_full_forward(is_mimo, is_outproj_norm):
    """mamba-ssm's Mamba3 step needs its CuTe kernel (GPU only), so the check is against our full forward; the
    cache tuple has mamba-ssm's shapes and its angle stays in [0, 2π)."""
    torch.manual_seed(0)
    m = perturbed(Mamba3(D_MODEL, d_state=8, headdim=8, ngroups=2, is_mimo=is_mimo, mimo_rank=2, chunk_size=8,
                         is_outproj_norm=is_outproj_norm, layer_idx=0, backend="reference").double())
    u = torch.randn(2, 10, D_MODEL, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        whole, final = m(u, return_final_state=True)
        y, cache = generate(m, u, prefill=4, layer_idx=0)
    torch.testing.assert_close(y, whole, atol=1e-12, rtol=1e-10)
    state = m.state_from_cache(cache)
    for name in final._fields:
        torch.testing.assert_close(getattr(state, name), getattr(final, name), atol=1e-12, rtol=1e-10)
    angle = cache[0]
    assert angle.min() >= 0 and angle.max() < 2 * math.pi
    h, p, n, r, a = m.nheads, m.headdim, m.d_state, m.mimo_rank, m.num_rope_angles
    assert [tuple(t.shape) for t in cache] == [(2, h, a), (2, h, p, n), (2, r, h, n), (2, h, p)]


def test_mamba3_cache_has_mamba_ssm_s_layout_and_dtypes():
    upstream = upstream_class("Mamba3")
    kw = dict(d_state=16, headdim=16, ngroups=2, device="meta", dtype=torch.bfloat16)
    theirs, ours = upstream(64, **kw), Mamba3(64, **kw)
    for a, b in zip(ours.allocate_inference_cache(3, 10), theirs.allocate_inference_cache(3, 10)):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)


def test_mamba3_angle_state_is_the_cumulative_angle_reduced_to_0_2pi():
    """θ_T = Σ_t ω_t Δ_t (from the block's own scan inputs) and the state's angle agree as rotations (cos, sin)
    and the state's lies in [0, 2π); the step form hands back what the tuple form writes."""
    torch.manual_seed(0)
    m = perturbed(Mamba3(D_MODEL, d_state=8, headdim=8, backend="reference").double())
    with torch.no_grad():
        m.in_proj.weight[-m.num_rope_angles:] *= 20     # angle rates near ±π ...
        m.dt_bias.fill_(2.0)                            # ... and Δ ≈ 2: θ winds several times round
        u = torch.randn(1, 12, D_MODEL, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        _, final = m(u, return_final_state=True)
        scan = m.scan_inputs(m.in_proj(u))
        theta = (scan["angles"] * scan["dt"][..., None]).sum(dim=1)                  # (b, h, a)
        assert theta.abs().max() > 4 * math.pi
        assert final.angle.min() >= 0 and final.angle.max() < 2 * math.pi
        torch.testing.assert_close(torch.cos(final.angle), torch.cos(theta), atol=1e-12, rtol=0)
        torch.testing.assert_close(torch.sin(final.angle), torch.sin(theta), atol=1e-12, rtol=0)
        token = u[:, :1]
        out_a, new = m.step(token, m.zero_state(1))
        cache = m.allocate_inference_cache(1, 1)
        out_b, *returned = m.step(token[:, 0], *cache)                              # mamba-ssm's (b, d_model) form
    torch.testing.assert_close(out_b, out_a[:, 0], atol=0, rtol=0)
    assert all(r is c for r, c in zip(returned, cache))                              # updated in place
    for name, t in zip(new._fields, m.state_from_cache(cache)):
        torch.testing.assert_close(t, getattr(new, name), atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------- Mamba2's edge cases
@pytest.mark.parametrize("scan", ["kernel", "reference"])
def test_mamba2_empty_sequence_gives_an_empty_output(scan):
    m = Mamba2(D_MODEL, d_state=8, headdim=8, chunk_size=16, scan=scan).to(KERNEL_DEVICE)
    u = torch.randn(2, 0, D_MODEL, device=KERNEL_DEVICE, requires_grad=True)
    out = m(u)
    assert out.shape == (2, 0, D_MODEL)
    out.sum().backward()
    assert u.grad.shape == u.shape
    cache = [t.fill_(1.0) for t in m.allocate_inference_cache(2)]
    with torch.no_grad():
        assert m(u, cache=cache).shape == (2, 0, D_MODEL)
    assert all(torch.equal(t, torch.zeros_like(t)) for t in cache)    # the state after no input: zero


@pytest.mark.parametrize("cast", [lambda m: m.double(), lambda m: m.to(torch.float64)], ids=["double", "to"])
def test_mamba2_in_float64_runs_forward_and_step_and_matches_fp32(cast):
    torch.manual_seed(0)
    m32 = perturbed(Mamba2(D_MODEL, d_state=8, headdim=8, chunk_size=16, layer_idx=0))  # scan="kernel"
    m64 = cast(Mamba2(D_MODEL, d_state=8, headdim=8, chunk_size=16, layer_idx=0))
    m64.load_state_dict(m32.state_dict())
    assert all(p.dtype == torch.float64 for p in m64.parameters())
    u = torch.randn(2, 11, D_MODEL, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        y64 = m64(u)
        y32 = m32.to(KERNEL_DEVICE)(u.float().to(KERNEL_DEVICE)).cpu()
        torch.testing.assert_close(y64.float(), y32, **FP32_KERNEL_TOL)
        y_steps, cache = generate(m64, u, prefill=5, layer_idx=0)
    assert y64.dtype == torch.float64 and cache[1].dtype == torch.float64
    torch.testing.assert_close(y_steps, y64, atol=1e-12, rtol=1e-10)


def test_mamba2_flattened_seqlen_form_equals_the_batched_form():
    m = Mamba2(D_MODEL, d_state=8, headdim=8, chunk_size=8, scan="reference")
    u = torch.randn(3, 7, D_MODEL)
    with torch.no_grad():
        torch.testing.assert_close(m(u.flatten(0, 1), seqlen=7), m(u).flatten(0, 1), atol=0, rtol=0)
    with pytest.raises(ValueError, match="seqlen = 5"):
        m(u.flatten(0, 1), seqlen=5)
