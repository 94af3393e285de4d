"""mambalab.kernels.ssd.state_sweep: steps 1-3 as one sweep with the state on chip, and the backward's state
sweep. Both against mambalab.ref.ssd: the forward's outputs, entering and final states; the backward's dS_c,
d initial and da_c against autograd through the reference's state passing and the entering states' part of
the outputs. (Whole gradients through the sweep: test_ssd_backward.py, test_mamba3_kernels.py.) Tiny sizes:
on the CPU they run in the interpreter, in fp32."""
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from mambalab import device
from mambalab.kernels import ssd as kernels
from mambalab.ref.ssd import chunk_diagonal_outputs, chunk_state_outputs, chunk_states, state_passing

from conftest import make_ssd_inputs, requires_gpu
from test_ssd_kernels import assert_close, cpu, on_device, reference_chunks

SHAPES = [
    # b, l, h, p, g, n, q, D, z, init, block_t, block_p
    (2, 37, 4, 8, 1, 8, 16, None, False, False, 16, None),    # g = 1, l = 2 q + 5: a padded last chunk
    (1, 70, 4, 16, 2, 16, 32, "hp", True, True, 32, None),    # g = 2, D (h, p), the gate, an initial state
    (2, 45, 2, 20, 2, 20, 32, "h", True, True, 16, 16),       # two row blocks a chunk, two p-blocks (one partial)
    (1, 64, 3, 8, 1, 8, 64, None, False, True, 16, None),     # four row blocks, whole chunks only
]
IDS = ["g1-padded", "g2-D-gate-init", "blocks", "q64-four-blocks"]


def _setup(b, l, h, p, g, n, q, D, z, init, block_t, block_p):
    inp = cpu(make_ssd_inputs(b, l, h, p, g, n, D=D, z=z, init=init, param_dtype=torch.float32))
    delta, cs, chunks = reference_chunks(inp, q, True)
    cfg = dataclasses.replace(kernels.tile_config(h, p, n, q), block_t=block_t)
    return inp, delta, cs, chunks, cfg


@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_forward_matches_reference(shape):
    b, l, h, p, g, n, q, D, z, init, block_t, block_p = shape
    inp, delta, cs, (xc, dtc, a, Bc, Cc), cfg = _setup(*shape)
    out, entering, final = kernels.state_sweep_fwd(
        *on_device(inp["x"], inp["B"], inp["C"], delta, cs, inp["initial_states"], inp["D"], inp["z"]), cfg,
        block_p=block_p)
    want_entering, want_final = state_passing(chunk_states(xc, dtc, a, Bc), a.sum(dim=2), inp["initial_states"])
    want = (chunk_diagonal_outputs(xc, dtc, a, Bc, Cc) + chunk_state_outputs(Cc, want_entering, a))
    want = want.flatten(1, 2)[:, :l]
    if D is not None:
        want = want + inp["x"] * (inp["D"].unsqueeze(-1) if inp["D"].dim() == 1 else inp["D"])
    if z:
        want = want * F.silu(inp["z"])
    assert out.shape == (b, l, h, p) and entering.shape == (b, -(-l // q), h, p, n) and final.dtype == torch.float32
    assert_close(out, want, "out")
    assert_close(entering, want_entering, "entering states")
    assert_close(final, want_final, "final state")


def reference_state_grads(inp, a, Bc, Cc, xc, dtc, l, dout, dfinal):
    """dS_c, d initial and da_c (b, h, c) by autograd through the reference: the states' recurrence
    (ref.ssd.state_passing) and what the entering states add to the outputs (chunk_state_outputs), gated by
    silu(z) when z is given, with dfinal reaching the final state."""
    states = chunk_states(xc, dtc, a, Bc).detach().requires_grad_(True)
    decay = a.sum(dim=2).detach().requires_grad_(True)                               # (b, c, h)
    init = None if inp["initial_states"] is None else inp["initial_states"].clone().requires_grad_(True)
    entering, final = state_passing(states, decay, init)
    y = chunk_state_outputs(Cc, entering, a).flatten(1, 2)[:, :l]
    dY = dout if inp["z"] is None else dout * F.silu(inp["z"])
    loss = (y * dY).sum() + (0 if dfinal is None else (final * dfinal).sum())
    leaves = [states, decay] + ([init] if init is not None else [])
    grads = torch.autograd.grad(loss, leaves)
    return grads[0], (grads[2] if init is not None else None), grads[1].transpose(1, 2)


@pytest.mark.parametrize("reduction", ["deterministic", "atomic"])
@pytest.mark.parametrize("shape", SHAPES, ids=IDS)
def test_backward_matches_reference(shape, reduction):
    b, l, h, p, g, n, q, D, z, init, block_t, block_p = shape
    inp, delta, cs, (xc, dtc, a, Bc, Cc), cfg = _setup(*shape)
    entering, _ = state_passing(chunk_states(xc, dtc, a, Bc), a.sum(dim=2), inp["initial_states"])
    gen = torch.Generator().manual_seed(5)
    dout = torch.randn(b, l, h, p, generator=gen)
    dfinal = torch.randn(b, h, p, n, generator=gen) if init else None
    want = reference_state_grads(inp, a, Bc, Cc, xc, dtc, l, dout, dfinal)
    got = kernels.state_sweep_bwd(*on_device(dout, inp["z"], inp["C"], cs, entering, dfinal), init, cfg, reduction,
                                  block_p=block_p)
    for name, g_, w in zip(("dS", "d initial", "da"), got, want):
        if w is None:
            assert g_ is None, name
        else:
            assert g_.shape == w.shape and g_.dtype == torch.float32, name
            assert_close(g_, w, name)
    assert got[2].abs().max() > 0 and got[0].abs().max() > 0   # the comparison is not between zeros


def test_stored_states_are_the_dots_dtype():
    """With 16-bit inputs the entering states are stored in x's dtype and the running state stays fp32: the
    final state is the fp32 sweep's within the rounding the dots see (fp16 here; the CPU interpreter stores
    it exactly), and every stored H_c is the fp32 sweep's rounded once, up to what the earlier rounded
    states feed into the outputs' dots."""
    shape = SHAPES[1]
    inp, delta, cs, _, cfg = _setup(*shape)
    args = on_device(inp["x"], inp["B"], inp["C"], delta, cs, inp["initial_states"], inp["D"], inp["z"])
    out32, ent32, fin32 = kernels.state_sweep_fwd(*args, cfg)
    half = [t.half() if i in (0, 1, 2, 7) else t for i, t in enumerate(args)]
    out16, ent16, fin16 = kernels.state_sweep_fwd(*half, cfg)
    assert ent16.dtype == out16.dtype == torch.float16 and fin16.dtype == torch.float32
    assert_close(ent16.float(), ent32.cpu(), "entering", atol=2e-3, rtol=2e-3)
    assert_close(fin16, fin32.cpu(), "final", atol=2e-3, rtol=2e-3)
    assert_close(out16.float(), out32.cpu(), "out", atol=2e-3, rtol=2e-3)

    # the backward: dS_c stored in the entering states' dtype, G running in fp32. With fp32 dout and C only
    # the stored dtype changes: dS is the fp32 run's rounded once, d initial its bits, and da the fp32
    # formula applied to the stored (rounded) entering states.
    gen = torch.Generator().manual_seed(3)
    dout = torch.randn(args[0].shape, generator=gen).to(args[0].device)
    dfinal = torch.randn(fin32.shape, generator=gen).to(args[0].device)
    C, z = args[2], args[7]
    dS, dinit, da = kernels.state_sweep_bwd(dout, z, C, cs.to(C.device), ent32, dfinal, True, cfg, "deterministic")
    dS16, dinit16, da16 = kernels.state_sweep_bwd(dout, z, C, cs.to(C.device), ent32.half(), dfinal, True, cfg,
                                                  "deterministic")
    assert dS16.dtype == torch.float16 and dinit16.dtype == da16.dtype == torch.float32
    assert torch.equal(dS16, dS.half()) and torch.equal(dinit16, dinit)
    _, _, da_from_stored = kernels.state_sweep_bwd(dout, z, C, cs.to(C.device), ent32.half().float(), dfinal, True,
                                                   cfg, "deterministic")
    assert torch.equal(da16, da_from_stored)
    assert not torch.equal(da16, da)                          # the rounding reaches da, and only da


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 3e-3), (torch.bfloat16, 3e-2)])
def test_gpu_sweep_matches_the_split_kernels(dtype, atol):
    """On the GPU (tf32 / bf16 dots): the forward sweep against the split steps 1-3 (the same dtypes and dots),
    the backward sweep against the fp32 reference on the CPU."""
    b, l, h, p, g, n, q = 2, 1000, 8, 64, 1, 128, 64
    inp = make_ssd_inputs(b, l, h, p, g, n, D=None, z=False, init=True, dtype=dtype, param_dtype=torch.float32,
                          device="cuda")
    ref_in = {k: (v.float().cpu() if v is not None else None) for k, v in inp.items()}
    delta, cs, (xc, dtc, a, Bc, Cc) = reference_chunks(ref_in, q, True)
    delta, cs = delta.cuda(), cs.cuda()
    cfg = kernels.tile_config(h, p, n, q, dtype)
    x, B, C, init = inp["x"], inp["B"], inp["C"], inp["initial_states"]
    prec = device.dot_precision(x.dtype, x.device)                      # what the ops pass: tf32 for fp32
    out, entering, final = kernels.state_sweep_fwd(x, B, C, delta, cs, init, None, None, cfg, prec)
    states = kernels.chunk_states_fwd(x, B, delta, cs, cfg, prec)
    want_entering, want_final = kernels.state_passing_fwd(states, cs, init, cfg, store_dtype=dtype)
    want_out = kernels.chunk_scan_fwd(x, B, C, delta, cs, want_entering, None, None, cfg, prec)
    for name, g_, w in (("out", out, want_out), ("entering", entering, want_entering), ("final", final, want_final)):
        assert_close(g_.float(), w.float().cpu(), name, atol=atol, rtol=atol)
    dout = torch.randn_like(x)
    dfinal = torch.randn_like(final)
    got = kernels.state_sweep_bwd(dout, None, C, cs, entering, dfinal, True, cfg, "deterministic", prec)
    want = reference_state_grads(ref_in, a, Bc, Cc, xc, dtc, l, dout.float().cpu(), dfinal.cpu())
    for name, g_, w in zip(("dS", "d initial", "da"), got, want):
        assert_close(g_.float(), w, name, atol=atol, rtol=atol)
    assert math.isfinite(got[2].abs().max().item())
