"""mambalab.kernels.ssd (forward) and mambalab.ops.ssd_chunk_scan_forward: each step's kernel against the
matching step of mambalab.ref.ssd, the whole forward against ssd_ref and mamba-ssm's
ssd_chunk_scan_combined_ref; strong decay stays finite; the tile rule; bad input named at the boundary.

On the CPU the kernels run in Triton's interpreter, in fp32; the sizes are tiny so the file stays fast."""
import math

import pytest
import torch
import torch.nn.functional as F

from mambalab import oracle, validate
from mambalab.kernels import ssd as kernels
from mambalab.ops.ssd import ssd_chunk_scan_forward
from mambalab.ref.ssd import (chunk_diagonal_outputs, chunk_state_outputs, chunk_states, effective_dt,
                              split_into_chunks, ssd_ref, state_passing)

from conftest import KERNEL_DEVICE, make_ssd_inputs, requires_gpu

NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def make_inputs(*shape, device=KERNEL_DEVICE, **kw):
    """SSD inputs (see conftest.make_ssd_inputs) with fp32 parameters, on the kernels' device."""
    return make_ssd_inputs(*shape, param_dtype=torch.float32, device=device, **kw)


def cpu(inputs):
    return {k: (v.float().cpu() if v is not None else None) for k, v in inputs.items()}


def assert_close(got, want, msg="", atol=2e-5, rtol=1e-4):
    """Agreement relative to the size of the reference (fp32 by default); returns the largest error."""
    got = got.float().cpu()
    scale = want.abs().max().item() + 1.0
    torch.testing.assert_close(got, want, atol=atol * scale, rtol=rtol, msg=msg)
    return (got - want).abs().max().item()


def reference_chunks(inp, q, dt_softplus=False, dt_limit=(0.0, math.inf)):
    """The reference's chunked inputs, as the kernels' layouts: Δ and cs (b, h, c, q); plus the reference's
    own (b, c, q, ...) tensors for its steps."""
    dt = effective_dt(inp["dt"], inp["dt_bias"], dt_softplus, dt_limit)
    xc, dtc, a, Bc, Cc = split_into_chunks(inp["x"], dt, inp["A"], inp["B"], inp["C"], q)
    delta = dtc.permute(0, 3, 1, 2).contiguous()                                # (b, h, c, q)
    cs = a.cumsum(dim=2).permute(0, 3, 1, 2).contiguous()                       # (b, h, c, q)
    return delta, cs, (xc, dtc, a, Bc, Cc)


def on_device(*ts):
    return [t.to(KERNEL_DEVICE).contiguous() if t is not None else None for t in ts]


# ---------------------------------------------------------------------------------------------- step by step
@pytest.mark.parametrize("q, softplus, limit, bias", [
    (16, False, (0.0, math.inf), False),
    (16, True, (0.3, 0.6), True),
    (32, True, (0.0, math.inf), True),
    (64, False, (0.2, 1.0), True),
])
def test_chunk_cumsum_matches_reference(q, softplus, limit, bias):
    b, l, h = 2, 45, 3                                                          # h not a power of two
    inp = cpu(make_inputs(b, l, h, 4, 1, 4, bias=bias))
    inp["dt"] = torch.randn(b, l, h, generator=torch.Generator().manual_seed(7))  # some negative steps
    cfg = kernels.tile_config(h, 4, 4, q)
    delta, cs = kernels.chunk_cumsum_fwd(*on_device(inp["dt"], inp["A"], inp["dt_bias"]), softplus, limit, cfg)
    want_delta, want_cs, _ = reference_chunks(inp, q, softplus, limit)
    assert delta.shape == cs.shape == (b, h, -(-l // q), q)
    assert_close(delta, want_delta, "delta")
    assert_close(cs, want_cs, "cs")
    assert delta.cpu().flatten(2)[..., l:].eq(0).all()                         # padding: Δ = 0


@pytest.mark.parametrize("b, l, h, p, g, n, q", [
    (2, 37, 4, 8, 1, 8, 16),     # g = 1, l = 2 q + 5
    (1, 70, 4, 16, 4, 16, 32),   # g = h, l = 2 q + 6
    (2, 80, 4, 8, 2, 4, 64),     # g = 2, l = q + 16
])
def test_chunk_states_matches_reference(b, l, h, p, g, n, q):
    inp = cpu(make_inputs(b, l, h, p, g, n))
    delta, cs, (xc, dtc, a, Bc, _) = reference_chunks(inp, q, True)
    states = kernels.chunk_states_fwd(*on_device(inp["x"], inp["B"], delta, cs), kernels.tile_config(h, p, n, q))
    assert states.shape == (b, -(-l // q), h, p, n)
    assert_close(states, chunk_states(xc, dtc, a, Bc), "chunk states")


@pytest.mark.parametrize("init", [False, True])
def test_state_passing_matches_reference(init):
    b, l, h, p, g, n, q = 2, 75, 3, 5, 1, 6, 16                                # p·n = 30: a partial block
    inp = cpu(make_inputs(b, l, h, p, g, n, init=init))
    delta, cs, (xc, dtc, a, Bc, _) = reference_chunks(inp, q)
    states = chunk_states(xc, dtc, a, Bc)
    entering, final = kernels.state_passing_fwd(*on_device(states, cs, inp["initial_states"]),
                                                kernels.tile_config(h, p, n, q))
    want_entering, want_final = state_passing(states, a.sum(dim=2), inp["initial_states"])
    assert_close(entering, want_entering, "entering states")
    assert_close(final, want_final, "final states")


def test_state_passing_stores_its_entering_states_in_the_dots_dtype():
    """With 16-bit inputs the entering states are stored in the dots' dtype, the recurrence still running in
    fp32: each stored tensor is the fp32 one rounded once and the final state is the fp32 run's bits. (fp16
    here: the CPU interpreter stores it exactly; the GPU runs use bf16 the same way. The backward's dS_c:
    test_state_sweep.py.)"""
    b, l, h, p, g, n, q = 2, 75, 3, 5, 1, 6, 16
    inp = cpu(make_inputs(b, l, h, p, g, n, init=True))
    delta, cs, (xc, dtc, a, Bc, _) = reference_chunks(inp, q)
    cfg = kernels.tile_config(h, p, n, q)
    states, cs_d, init = on_device(chunk_states(xc, dtc, a, Bc), cs, inp["initial_states"])
    wide, final = kernels.state_passing_fwd(states, cs_d, init, cfg)
    narrow, final16 = kernels.state_passing_fwd(states, cs_d, init, cfg, store_dtype=torch.float16)
    assert wide.dtype == final.dtype == final16.dtype == torch.float32 and narrow.dtype == torch.float16
    assert torch.equal(narrow, wide.half()) and torch.equal(final16, final)


@pytest.mark.parametrize("b, l, h, p, g, n, q, D, z", [
    (2, 37, 4, 8, 1, 8, 16, None, False),     # steps 1 + 4 of the reference, nothing else
    (1, 45, 2, 16, 2, 16, 32, "hp", True),    # with D (h, p) and the gate
    (1, 20, 4, 4, 2, 4, 16, "h", True),       # D (h,)
])
def test_chunk_scan_matches_reference(b, l, h, p, g, n, q, D, z):
    inp = cpu(make_inputs(b, l, h, p, g, n, D=D, z=z))
    delta, cs, (xc, dtc, a, Bc, Cc) = reference_chunks(inp, q, True)
    entering, _ = state_passing(chunk_states(xc, dtc, a, Bc), a.sum(dim=2), inp["initial_states"])
    out = kernels.chunk_scan_fwd(*on_device(inp["x"], inp["B"], inp["C"], delta, cs, entering, inp["D"], inp["z"]),
                                 kernels.tile_config(h, p, n, q))
    want = (chunk_diagonal_outputs(xc, dtc, a, Bc, Cc) + chunk_state_outputs(Cc, entering, a)).flatten(1, 2)[:, :l]
    if D is not None:
        want = want + inp["x"] * (inp["D"].unsqueeze(-1) if inp["D"].dim() == 1 else inp["D"])
    if z:
        want = want * F.silu(inp["z"])
    assert_close(out, want, "out")


# ---------------------------------------------------------------------------------------------- whole forward
CASES = [
    # b, l, h, p, g, n, q, D, z, bias, softplus, init, dt_limit
    (1, 1, 1, 4, 1, 4, 16, None, False, False, False, False, None),     # one step
    (2, 37, 4, 8, 1, 8, 16, "h", True, True, True, True, None),         # g = 1, l = 2 q + 5
    (2, 70, 4, 8, 4, 16, 32, "hp", True, False, True, True, None),      # g = h, l = 2 q + 6
    (1, 80, 2, 16, 2, 8, 64, "h", False, True, False, True, None),      # g = h, l = q + 16
    (2, 32, 2, 8, 1, 8, 32, None, True, True, True, False, None),       # exactly one chunk, no initial state
    (1, 50, 4, 4, 2, 4, 16, "hp", True, True, True, True, (0.3, 0.7)),  # g = 2, dt_limit bites
    (2, 77, 3, 8, 1, 8, 64, "hp", True, True, True, True, (0.1, 0.4)),  # h = 3, l = q + 13
    (2, 80, 4, 16, 2, 16, 16, None, True, False, False, True, None),    # five whole chunks, no softplus
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}l{}h{}p{}g{}n{}q{}".format(*c[:7]))
def test_forward_matches_ssd_ref(case):
    b, l, h, p, g, n, q, D, z, bias, softplus, init, limit = case
    limit = limit or (0.0, math.inf)
    inp = make_inputs(b, l, h, p, g, n, D=D, z=z, bias=bias, init=init)
    kw = dict(D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], initial_states=inp["initial_states"],
              dt_softplus=softplus, dt_limit=limit)
    res = kernels.ssd_chunk_scan_fwd(*(inp[k] for k in NAMES[:5]), q, **kw)
    ref_in = cpu(inp)
    want_out, want_final = ssd_ref(*(ref_in[k] for k in NAMES[:5]), q, return_final_states=True,
                                   **dict(kw, **{k: ref_in[k] for k in NAMES[5:]}))
    assert res.out.shape == (b, l, h, p) and res.out.dtype == inp["x"].dtype
    assert_close(res.out, want_out, "out")
    assert_close(res.final_states, want_final, "final states")
    # the saved intermediates are the reference's
    delta, cs, (xc, dtc, a, Bc, _) = reference_chunks(ref_in, q, softplus, limit)
    assert_close(res.delta, delta, "delta")
    assert_close(res.dA_cumsum, cs, "dA_cumsum")
    want_entering, _ = state_passing(chunk_states(xc, dtc, a, Bc), a.sum(dim=2), ref_in["initial_states"])
    assert_close(res.entering_states, want_entering, "entering states")


def test_tiles_smaller_than_the_problem():
    """Tiles smaller than the head and the chunk: two p-blocks (the second partial), two steps over n (the
    second partial), two row blocks per chunk (the second also visiting the first's columns), two steps over
    the positions in chunk states, and state-passing blocks smaller than p·n."""
    b, l, h, p, g, n, q = 1, 40, 2, 20, 1, 20, 32
    inp = make_inputs(b, l, h, p, g, n, D="hp")
    cfg = kernels.TileConfig(chunk_size=q, block_t=16, block_h=1, block_p=16, block_n=32, block_k=16, block_pn=64,
                             num_warps=4, bwd_block_t=16, bwd_num_warps=4, states_block_t=16, states_num_warps=4,
                             sweep_bwd_block_p=16)
    kw = dict(D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], initial_states=inp["initial_states"], dt_softplus=True)
    res = kernels.ssd_chunk_scan_fwd(*(inp[k] for k in NAMES[:5]), q, cfg=cfg, **kw)
    ref_in = cpu(inp)
    want_out, want_final = ssd_ref(*(ref_in[k] for k in NAMES[:5]), q, return_final_states=True,
                                   **dict(kw, **{k: ref_in[k] for k in NAMES[5:]}))
    assert_close(res.out, want_out, "out")
    assert_close(res.final_states, want_final, "final states")


@pytest.mark.parametrize("b, l, h, p, g, n, q, D", [
    (2, 32, 4, 8, 1, 8, 16, "h"),
    (1, 64, 4, 4, 4, 8, 32, "hp"),
])
def test_forward_matches_mamba_ssm_reference(b, l, h, p, g, n, q, D):
    """mamba-ssm's chunked reference: no initial or final states, l a multiple of q, and a small total decay
    (its state_passing_ref exps unmasked differences of chunk cumsums, which overflow past a decay of 88)."""
    theirs = oracle.module("ops.triton.ssd_combined").ssd_chunk_scan_combined_ref
    inp = make_inputs(b, l, h, p, g, n, D=D, init=False)
    inp["dt"] = inp["dt"] - 2.0                                                 # softplus(dt) about 0.15
    kw = dict(D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], dt_softplus=True)
    out = ssd_chunk_scan_forward(*(inp[k] for k in NAMES[:5]), q, **kw)
    ref_in = cpu(inp)
    want = theirs(*(ref_in[k] for k in NAMES[:5]), q, **{k: ref_in[k] for k in ("D", "z", "dt_bias")},
                  dt_softplus=True)
    assert_close(out, want, "out")


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_strong_decay_stays_finite():
    """Δ A down to about -5000 a step: the chunk cumsum reaches about -1e4 or less, so exp(cs_t - cs_s) above
    the diagonal would overflow to inf (and inf · 0 = NaN where the mask multiplies) if the causal mask came
    after the exp. It comes before, so the exponent is never positive: in the interpreter, numpy's overflow
    warning (an error here) would say otherwise."""
    b, l, h, p, g, n, q = 1, 40, 2, 4, 1, 4, 16
    inp = make_inputs(b, l, h, p, g, n)
    inp["A"] = torch.tensor([-1e4, -0.5], device=KERNEL_DEVICE)
    kw = dict(D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], initial_states=inp["initial_states"])
    out, final = ssd_chunk_scan_forward(*(inp[k] for k in NAMES[:5]), q, return_final_states=True, **kw)
    assert torch.isfinite(out).all() and torch.isfinite(final).all()
    ref_in = cpu(inp)
    want_out, want_final = ssd_ref(*(ref_in[k] for k in NAMES[:5]), q, return_final_states=True,
                                   **{k: ref_in[k] for k in NAMES[5:]})
    assert_close(out, want_out, "out")
    assert_close(final, want_final, "final states")


# ---------------------------------------------------------------------------------------------- the op
def test_op_matches_reference_and_keeps_dtypes():
    inp = make_inputs(2, 20, 2, 4, 1, 4, D="hp", dtype=torch.bfloat16)
    kw = {k: inp[k] for k in NAMES[5:]}
    out, final = ssd_chunk_scan_forward(*(inp[k] for k in NAMES[:5]), 16, dt_softplus=True, return_final_states=True,
                                        **kw)
    assert out.dtype == torch.bfloat16 and out.shape == inp["x"].shape
    assert final.dtype == torch.float32 and final.shape == (2, 2, 4, 4)
    want_out, want_final = ssd_ref(*(inp[k].cpu() for k in NAMES[:5]), 16, dt_softplus=True, return_final_states=True,
                                   **{k: v.cpu() for k, v in kw.items()})
    assert_close(out, want_out.float(), "out", atol=1e-2, rtol=1e-2)           # the reference rounds to bf16 too
    assert_close(final, want_final, "final states")
    assert ssd_chunk_scan_forward(*(inp[k] for k in NAMES[:5]), 16).shape == inp["x"].shape   # out alone


def test_op_is_batch_invariant_and_reproducible():
    """Row 0 gets the same bits alone as inside a batch, and a second run the same bits as the first."""
    full = make_inputs(3, 24, 2, 4, 1, 4)
    one = {k: (v[:1] if k in ("x", "dt", "B", "C", "z", "initial_states") else v) for k, v in full.items()}
    run = lambda inp: ssd_chunk_scan_forward(*(inp[k] for k in NAMES[:5]), 16, return_final_states=True,
                                             dt_softplus=True, **{k: inp[k] for k in NAMES[5:]})
    out3, final3 = run(full)
    out1, final1 = run(one)
    assert torch.equal(out3[:1], out1) and torch.equal(final3[:1], final1)
    again, _ = run(full)
    assert torch.equal(out3, again)


def test_op_refuses_to_record_a_graph():
    inp = make_inputs(1, 16, 2, 4, 1, 4)
    x = inp["x"].clone().requires_grad_()
    with pytest.raises(NotImplementedError, match="records no autograd graph"):
        ssd_chunk_scan_forward(x, *(inp[k] for k in NAMES[1:5]), 16)
    with torch.no_grad():
        out = ssd_chunk_scan_forward(x, *(inp[k] for k in NAMES[1:5]), 16)
    assert not out.requires_grad


def test_tile_rule():
    cfg = kernels.tile_config(h=24, p=64, n=128, chunk_size=256)               # fp32 (the default dtype)
    assert (cfg.block_t, cfg.block_h, cfg.block_p, cfg.block_n, cfg.block_k, cfg.block_pn) == (
        64, 16, 64, 128, 64, 1024)
    assert (cfg.bwd_block_t, cfg.bwd_num_warps, cfg.num_warps) == (32, 4, 4)
    for dtype in (torch.bfloat16, torch.float16):                               # pinned per dtype: 16-bit operands
        half = kernels.tile_config(24, 64, 128, 256, dtype)
        assert (half.block_t, half.block_p, half.block_n) == (cfg.block_t, cfg.block_p, cfg.block_n)
        assert (half.bwd_block_t, half.bwd_num_warps, half.num_warps) == (64, 4, 8)
    assert kernels.tile_config(24, 64, 128, 32, torch.bfloat16).bwd_block_t == 32   # never beyond the chunk
    # fp32: the chunk states' own positions a step and warps, the chunk-scan forward unpipelined; 16-bit: the
    # forward's block_t and warps, Triton's 3 stages
    assert (cfg.states_block_t, cfg.states_num_warps, cfg.num_stages, cfg.bwd_num_stages) == (32, 2, 1, 3)
    assert (half.states_block_t, half.states_num_warps, half.num_stages) == (64, 8, 3)
    assert kernels.tile_config(24, 64, 128, 16).states_block_t == 16                # never beyond the chunk
    # the sweeps: the forward for 16-bit inputs and chunks of one block (the rule's warps); the backward 32
    # head dimensions a program
    assert (cfg.sweep_forward, cfg.sweep_bwd_block_p) == (False, 32)
    # C Bᵀ formed once per group: fp32 with 8 or more heads a group; never for 16-bit inputs, nor when the
    # caller gives no group count
    assert [kernels.tile_config(24, 64, 128, 256, ngroups=g).precompute_cb for g in (1, 3, 4, 24)] == \
        [True, True, False, False]
    assert not cfg.precompute_cb and not kernels.tile_config(24, 64, 128, 256, torch.bfloat16, 1).precompute_cb
    assert (half.sweep_forward, half.sweep_bwd_block_p) == (False, 32)   # q = 256
    assert kernels.tile_config(24, 64, 128, 64, torch.bfloat16).sweep_forward
    assert not kernels.tile_config(24, 64, 128, 64).sweep_forward                               # fp32
    assert kernels.tile_config(3, 16, 16, 16).sweep_bwd_block_p == 16
    small = kernels.tile_config(h=3, p=5, n=6, chunk_size=16, dtype=torch.bfloat16)
    assert (small.block_t, small.block_h, small.block_p, small.block_n, small.block_k, small.block_pn) == (
        16, 4, 16, 16, 16, 32)
    assert small.num_warps == 4                                                 # a small state tile: 4 warps
    assert kernels.tile_config(8, 80, 16, 64).block_p == 64                    # p = 80: two p-blocks
    ok = dict(chunk_size=32, block_t=16, block_h=1, block_p=16, block_n=32, block_k=16, block_pn=64, num_warps=4,
              bwd_block_t=16, bwd_num_warps=4, states_block_t=16, states_num_warps=4, sweep_bwd_block_p=16)
    for change, words in ((dict(block_p=8), "block_p=8 must be at least 16"),
                          (dict(chunk_size=24), "power of two >= 16"),
                          (dict(block_t=64), "block_t=64 must be a power of two >= 16 dividing"),
                          (dict(bwd_block_t=8), "bwd_block_t=8 must be a power of two >= 16 dividing"),
                          (dict(states_block_t=48), "states_block_t=48 must be a power of two >= 16 dividing"),
                          (dict(sweep_bwd_block_p=8), "sweep_bwd_block_p=8 must be at least 16"),
                          (dict(block_k=64), "block_k=64 must divide")):
        with pytest.raises(ValueError, match=words):
            kernels.TileConfig(**dict(ok, **change))


# ---------------------------------------------------------------- bad input: clear errors, no launch
def _valid():
    return make_inputs(2, 8, 4, 4, 2, 4, D="h", device=KERNEL_DEVICE)


@pytest.mark.parametrize("change, exc, words", [
    (lambda x: x.update(x=x["x"][0]), ValueError, r"x must have shape \(b, l, h, p\)"),
    (lambda x: x.update(dt=x["dt"][:, :5]), ValueError, "dt must have shape"),
    (lambda x: x.update(A=x["A"][:3]), ValueError, r"A must have shape \(h,\)"),
    (lambda x: x.update(B=x["B"][:1]), ValueError, "B must have shape"),
    (lambda x: x.update(C=x["C"][..., :2]), ValueError, "C must have shape"),
    (lambda x: x.update(B=torch.randn(2, 8, 3, 4, device=KERNEL_DEVICE), C=torch.randn(2, 8, 3, 4, device=KERNEL_DEVICE)), ValueError, "must divide the heads"),
    (lambda x: x.update(D=torch.ones(3, device=KERNEL_DEVICE)), ValueError, r"D must have shape \(h,\) or \(h, p\)"),
    (lambda x: x.update(D=torch.ones(4, 3, device=KERNEL_DEVICE)), ValueError, r"D must have shape \(h, p\)"),
    (lambda x: x.update(z=x["z"][:1]), ValueError, "z must have shape"),
    (lambda x: x.update(dt_bias=torch.ones(4, 1, device=KERNEL_DEVICE)), ValueError, "dt_bias must have shape"),
    (lambda x: x.update(initial_states=torch.ones(2, 4, 4, 5, device=KERNEL_DEVICE)), ValueError, "initial_states must have shape"),
    (lambda x: x.update(x=x["x"].to(torch.int32)), TypeError, "x must have dtype"),
    (lambda x: x.update(A=torch.complex(x["A"], x["A"])), TypeError, "A must be real"),
    (lambda x: x.update(B=x["B"].cpu().numpy()), TypeError, "B must be a torch.Tensor"),
    (lambda x: x.update(D=x["D"].to("meta")), ValueError, "D is on meta"),
    (lambda x: x["dt"].__setitem__((0, 0, 0), math.nan), ValueError, "dt contains NaN"),
    (lambda x: x.update(chunk_size=24), ValueError, "chunk_size must be a power of two"),
    (lambda x: x.update(chunk_size=8), ValueError, "chunk_size must be at least 16"),
    (lambda x: x.update(chunk_size=0), ValueError, "chunk_size must be a positive int"),
    (lambda x: x.update(dt_limit=(1.0, 0.5)), ValueError, "dt_limit must be"),
    (lambda x: x.update(dt_limit=0.5), ValueError, "dt_limit must be a pair"),
])
def test_bad_input_is_named(change, exc, words):
    x = _valid()
    x.update(chunk_size=16, dt_limit=(0.0, math.inf))
    change(x)
    with pytest.raises(exc, match=words):
        ssd_chunk_scan_forward(*(x[k] for k in NAMES[:5]), x["chunk_size"], **{k: x[k] for k in NAMES[5:]},
                               dt_limit=x["dt_limit"])


def test_more_chunks_than_a_launch_grid_holds_is_named():
    """The kernels put the chunks on a grid axis that CUDA caps at 65,535 programs: one chunk more is named
    with the chunk_size that would do, before anything launches (the inputs are expanded views, no memory)."""
    x = _valid()
    l = 16 * validate.MAX_CHUNKS + 1
    stretch = lambda t: t[:, :1].expand(t.shape[0], l, *t.shape[2:])
    long = {k: stretch(x[k]) if k in ("x", "dt", "B", "C", "z") else x[k] for k in NAMES}
    with pytest.raises(ValueError, match=f"l = {l} at chunk_size = 16 makes 65536 chunks.*chunk_size = 32 or more"):
        ssd_chunk_scan_forward(*(long[k] for k in NAMES[:5]), 16, **{k: long[k] for k in NAMES[5:]})


# ---------------------------------------------------------------- mamba-ssm's signature
def _parameters(fn):
    import inspect

    return [(name, p.kind, p.default) for name, p in inspect.signature(fn).parameters.items()]


@pytest.mark.parametrize("op", ["ssd_chunk_scan", "ssd_chunk_scan_forward"])
def test_signature_is_mamba_chunk_scan_combined_s(op):
    """Every parameter of mamba-ssm's mamba_chunk_scan_combined, in its order, with its default; mambalab's
    own (reduction) only after them, keyword-only."""
    import inspect

    from mambalab import ops

    theirs = _parameters(oracle.module("ops.triton.ssd_combined").mamba_chunk_scan_combined)
    ours = _parameters(getattr(ops, op))
    assert ours[:len(theirs)] == theirs
    assert all(kind == inspect.Parameter.KEYWORD_ONLY for _, kind, _ in ours[len(theirs):])
    assert [name for name, _, _ in ours[len(theirs):]] == (["reduction"] if op == "ssd_chunk_scan" else [])


def test_positional_call_binds_as_mamba_ssm_s():
    """All sixteen of mamba-ssm's arguments given by position (as a caller of mamba_chunk_scan_combined may)
    give what the same call by keyword gives, and what ssd_ref gives for it."""
    inp = make_inputs(1, 20, 2, 16, 1, 16)
    limit = (0.0, 0.3)
    args = [inp[k] for k in NAMES[:5]] + [16] + [inp[k] for k in NAMES[5:]]
    out, final = ssd_chunk_scan_forward(*args, None, None, True, limit, True, False)
    kw_out, kw_final = ssd_chunk_scan_forward(*args[:6], **{k: inp[k] for k in NAMES[5:]}, dt_softplus=True,
                                              dt_limit=limit, return_final_states=True)
    assert torch.equal(out, kw_out) and torch.equal(final, kw_final)
    want, want_final = ssd_ref(**cpu(inp), dt_softplus=True, dt_limit=limit, return_final_states=True,
                               method="recurrent")
    assert_close(out, want, "out")
    assert_close(final, want_final, "final_states")


@pytest.mark.parametrize("name, value", [("seq_idx", "decreasing"), ("return_varlen_states", True)])
@pytest.mark.parametrize("op", ["ssd_chunk_scan", "ssd_chunk_scan_forward"])
def test_bad_packed_sequences_are_named_before_any_launch(op, name, value, monkeypatch):
    """Packed sequences are supported (tests/test_ssd_varlen.py); a bad one is named before any launch."""
    from mambalab import ops

    def no_launch(*a, **k):
        raise AssertionError("a kernel was launched")

    monkeypatch.setattr(kernels, "ssd_chunk_scan_fwd", no_launch)
    inp = make_inputs(1, 16, 2, 4, 1, 4)
    if value == "decreasing":
        value = torch.tensor([[1] * 8 + [0] * 8], dtype=torch.int32).to(KERNEL_DEVICE)
    with pytest.raises(ValueError, match=name):
        getattr(ops, op)(*(inp[k] for k in NAMES[:5]), 16, **{name: value})


def test_packed_sequence_arguments_at_their_defaults_change_nothing():
    inp = make_inputs(1, 16, 2, 16, 1, 16)
    plain = ssd_chunk_scan_forward(*(inp[k] for k in NAMES[:5]), 16, **{k: inp[k] for k in NAMES[5:]})
    given = ssd_chunk_scan_forward(*(inp[k] for k in NAMES[:5]), 16, **{k: inp[k] for k in NAMES[5:]},
                                   seq_idx=None, cu_seqlens=None, return_varlen_states=False)
    assert torch.equal(plain, given)


# ---------------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 3e-3), (torch.bfloat16, 3e-2), (torch.float16, 5e-3)])  # fp32: tf32 dots
@pytest.mark.parametrize("q", [64, 128, 256])
def test_gpu_forward_matches_ssd_ref(dtype, atol, q):
    """Mamba-2 sizes: p = 64, n = 128, several chunks, l not a multiple of q, g = 1 and g = h."""
    for g in (1, 8):
        inp = make_inputs(2, 1000, 8, 64, g, 128, D="h", dtype=dtype)
        kw = dict(dt_softplus=True, return_final_states=True, dt_limit=(0.0, 1.0))
        out, final = ssd_chunk_scan_forward(*(inp[k] for k in NAMES[:5]), q, **{k: inp[k] for k in NAMES[5:]}, **kw)
        ref_in = {k: (v.float() if v is not None else None) for k, v in inp.items()}
        want_out, want_final = ssd_ref(*(ref_in[k] for k in NAMES[:5]), q, **{k: ref_in[k] for k in NAMES[5:]}, **kw)
        assert out.dtype == dtype
        assert_close(out, want_out.cpu(), f"out g={g}", atol=atol, rtol=atol)
        assert_close(final, want_final.cpu(), f"final g={g}", atol=atol, rtol=atol)


@pytest.mark.gpu
@requires_gpu
def test_gpu_matches_mamba_ssm_triton_kernel():
    """mamba-ssm's own Triton forward (mamba_chunk_scan_combined) on the same inputs, bf16; its autotuners try
    their smallest configuration only (oracle.single_config(smallest=True): minutes of compiling saved;
    the first ones ask for more shared memory than an H200 has; any configuration meets the tolerance)."""
    combined = oracle.module("ops.triton.ssd_combined").mamba_chunk_scan_combined
    inp = make_inputs(2, 1000, 8, 64, 1, 128, D="h", dtype=torch.bfloat16)
    kw = dict(D=inp["D"], z=inp["z"], dt_bias=inp["dt_bias"], initial_states=inp["initial_states"], dt_softplus=True,
              return_final_states=True)
    out, final = ssd_chunk_scan_forward(*(inp[k] for k in NAMES[:5]), 256, **kw)
    with oracle.single_config("mamba_ssm.ops.triton", smallest=True):
        want_out, want_final = combined(*(inp[k] for k in NAMES[:5]), 256, **kw)
    assert_close(out, want_out.float().cpu(), "out", atol=3e-2, rtol=3e-2)
    assert_close(final, want_final.float().cpu(), "final states", atol=3e-2, rtol=3e-2)
