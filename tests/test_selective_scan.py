"""mambalab.ops.selective_scan against mamba-ssm's selective_scan_ref (the oracle), forward and every
gradient; determinism; batch invariance; input validation."""
import math

import pytest
import torch

from mambalab import device, oracle
from mambalab.kernels import selective_scan as kernels
from mambalab.ops import selective_scan
from mambalab.ref.selective_scan import selective_scan_ref as our_ref

from conftest import KERNEL_DEVICE, requires_gpu

NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def make_inputs(b, d, n, l, g=None, *, D=True, z=True, bias=True, dtype=torch.float32, device=KERNEL_DEVICE,
                seed=0):
    """Random inputs in mamba-ssm's layout. g=None: B and C of shape (b, n, l); else (b, g, n, l)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)
    bc = (b, n, l) if g is None else (b, g, n, l)
    x = {
        "u": r(b, d, l),
        "delta": 0.5 * torch.rand(b, d, l, generator=gen),
        "A": -(0.5 + torch.rand(d, n, generator=gen)),
        "B": r(*bc),
        "C": r(*bc),
        "D": r(d) if D else None,
        "z": r(b, d, l) if z else None,
        "delta_bias": 0.1 * r(d) if bias else None,
    }
    out = {}
    for k, v in x.items():
        if v is None:
            out[k] = None
            continue
        v = v.to(device)
        if k in ("u", "delta", "B", "C", "z"):
            v = v.to(dtype)
        out[k] = v
    return out


def run(fn, inputs, dout, **kw):
    leaves = {k: (v.detach().clone().requires_grad_() if v is not None else None) for k, v in inputs.items()}
    res = fn(*(leaves[k] for k in NAMES[:5]), D=leaves["D"], z=leaves["z"], delta_bias=leaves["delta_bias"], **kw)
    out, last = res if isinstance(res, tuple) else (res, None)
    out.backward(dout)
    grads = {k: v.grad for k, v in leaves.items() if v is not None}
    return out.detach(), last, grads


CASES = [
    # b, d, n, l, g, D, z, bias, softplus, last_state
    (1, 4, 4, 1, None, False, False, False, False, False),
    (2, 4, 3, 17, None, True, True, True, True, True),
    (2, 6, 16, 45, 2, True, False, True, True, False),     # grouped B/C, d/g = 3 -> one channel per program
    (1, 8, 16, 130, 2, True, True, False, False, True),
    (2, 8, 5, 33, 8, False, True, True, True, True),       # g = d
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}d{}n{}l{}g{}".format(*c[:5]))
def test_matches_mamba_ssm_reference(case):
    b, d, n, l, g, D, z, bias, softplus, last_state = case
    inputs = make_inputs(b, d, n, l, g, D=D, z=z, bias=bias)
    dout = torch.randn(b, d, l, generator=torch.Generator().manual_seed(1)).to(KERNEL_DEVICE)
    kw = dict(delta_softplus=softplus, return_last_state=last_state)
    out, last, grads = run(selective_scan, inputs, dout, **kw)
    cpu_inputs = {k: (v.cpu() if v is not None else None) for k, v in inputs.items()}
    ref_out, ref_last, ref_grads = run(oracle.selective_scan_ref(), cpu_inputs, dout.cpu(), **kw)

    torch.testing.assert_close(out.cpu(), ref_out, atol=2e-5, rtol=1e-4)
    if last_state:
        torch.testing.assert_close(last.cpu(), ref_last, atol=2e-5, rtol=1e-4)
    assert set(grads) == set(ref_grads)
    for k in ref_grads:
        scale = ref_grads[k].abs().max().item() + 1.0
        torch.testing.assert_close(grads[k].cpu(), ref_grads[k], atol=2e-5 * scale, rtol=1e-4, msg=k)
        assert grads[k].dtype == inputs[k].dtype and grads[k].shape == inputs[k].shape


def test_our_reference_matches_mamba_ssm_reference():
    inputs = make_inputs(2, 4, 3, 19, 2, device="cpu")
    dout = torch.randn(2, 4, 19)
    a = run(our_ref, inputs, dout, delta_softplus=True, return_last_state=True)
    b = run(oracle.selective_scan_ref(), inputs, dout, delta_softplus=True, return_last_state=True)
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])
    for k in b[2]:
        torch.testing.assert_close(a[2][k], b[2][k], msg=k)


def test_forward_without_grad_skips_the_saved_states():
    x = make_inputs(1, 4, 4, 20, None)
    with torch.no_grad():
        out_nograd = selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], D=x["D"], z=x["z"])
    out, last, saved, _ = kernels.selective_scan_fwd(x["u"], x["delta"], x["A"], x["B"].unsqueeze(1),
                                                     x["C"].unsqueeze(1), x["D"], x["z"], None, False,
                                                     save_states=False)
    assert saved is None
    assert torch.equal(out, out_nograd)


def test_backward_is_bitwise_reproducible():
    # l = 20: one block of 32 steps, 12 of them masked, as l = 70 was one block of 128: the same programs and
    # partials (b = 2, two groups of 4 channels); in the interpreter a run takes 6 s instead of 20
    inputs = make_inputs(2, 8, 16, 20, 2)
    dout = torch.randn(2, 8, 20, generator=torch.Generator().manual_seed(3)).to(KERNEL_DEVICE)
    first = run(selective_scan, inputs, dout, delta_softplus=True)[2]
    for _ in range(2):
        again = run(selective_scan, inputs, dout, delta_softplus=True)[2]
        for k in first:
            assert torch.equal(first[k], again[k]), k


def test_batch_invariance():
    """Row 0 gets the same bits alone as inside a batch with other rows (outputs and per-row gradients)."""
    full = make_inputs(3, 4, 8, 40, None)
    dout = torch.randn(3, 4, 40, generator=torch.Generator().manual_seed(4)).to(KERNEL_DEVICE)
    one = {k: (v[:1] if k in ("u", "delta", "B", "C", "z") else v) for k, v in full.items()}
    out3, _, g3 = run(selective_scan, full, dout, delta_softplus=True)
    out1, _, g1 = run(selective_scan, one, dout[:1], delta_softplus=True)
    assert torch.equal(out3[:1], out1)
    for k in ("u", "delta", "B", "C", "z"):
        assert torch.equal(g3[k][:1], g1[k]), k


def test_tile_rule():
    assert kernels.tile_config(6, 16, 100).bwd_block_d == 2      # divides the 6 channels of a group
    assert kernels.tile_config(3, 5, 100).block_d == kernels.tile_config(3, 5, 100).bwd_block_d == 1
    assert kernels.tile_config(64, 16, 100).block_d == 1                # the forward: one channel a program
    assert kernels.tile_config(64, 16, 100).bwd_block_d == 4
    assert kernels.tile_config(3, 5, 100).block_n == 8
    big = kernels.tile_config(2048, 16, 8192)
    assert (big.block_d, big.block_l, big.bwd_block_d, big.bwd_block_l) == (1, 512, 4, 128)
    short = kernels.tile_config(2048, 16, 20)                    # short sequences get short blocks
    assert (short.block_l, short.bwd_block_l) == (32, 32)
    assert kernels.tile_config(2048, 16, 1).block_l == 16
    for l in (1, 17, 100, 300, 1000, 5000):
        cfg = kernels.tile_config(1024, 16, l)
        assert cfg.block_l % cfg.bwd_block_l == 0
    with pytest.raises(ValueError, match="multiple of bwd_block_l"):
        kernels.TileConfig(1, 16, 48, 1, 1, 32, 1)


@pytest.mark.skipif(not device.interpreter_active(), reason="the interpreter's forward tile: a CPU rule")
def test_interpreter_forward_tile_gives_the_gpu_rules_bits():
    """On the CPU the forward runs INTERPRETER_BLOCK_D channels a program; with the GPU's rule (one channel a
    program) the output, the last state and every saved checkpoint are the same bits: each channel's scan is its
    own. Two groups of 12 channels (4 a program)."""
    inp = make_inputs(2, 24, 8, 40, g=2)
    B, C = inp["B"].contiguous(), inp["C"].contiguous()
    args = (inp["u"], inp["delta"], inp["A"], B, C, inp["D"], inp["z"], inp["delta_bias"], True)
    wide = kernels.selective_scan_fwd(*args)
    assert wide[3].block_d == 4
    gpu_rule = kernels.selective_scan_fwd(*args, cfg=kernels.tile_config(12, 8, 40))
    assert gpu_rule[3].block_d == 1
    for a, b in zip((wide[0], wide[1], wide[2].states, wide[2].y), (gpu_rule[0], gpu_rule[1], gpu_rule[2].states,
                                                                     gpu_rule[2].y)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("block_d, block_l, bwd_block_d, bwd_block_l", [
    (1, 16, 1, 16), (2, 32, 2, 16), (4, 64, 4, 16), (2, 32, 4, 32)])
def test_state_carried_across_many_blocks(block_d, block_l, bwd_block_d, bwd_block_l):
    """Small tiles force many sequence blocks: the forward carries the state (and saves it every
    bwd_block_l steps, also inside its own blocks), the backward carries the adjoint."""
    b, d, n, l, g = 2, 8, 4, 75, 2
    x = make_inputs(b, d, n, l, g)
    dout = torch.randn(b, d, l, generator=torch.Generator().manual_seed(6)).to(KERNEL_DEVICE)
    cfg = kernels.TileConfig(block_d, 4, block_l, 2, bwd_block_d, bwd_block_l, 2)
    out, last, saved, cfg = kernels.selective_scan_fwd(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"],
                                                       x["delta_bias"], True, cfg=cfg)
    assert saved.states.shape[1] == -(-l // bwd_block_l) + 1      # a slot per backward block, then the last state
    grads = kernels.selective_scan_bwd(dout, x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"],
                                       x["delta_bias"], True, saved, cfg)
    cpu = {k: v.cpu() for k, v in x.items()}
    ref_out, ref_last, ref_grads = run(oracle.selective_scan_ref(), cpu, dout.cpu(), delta_softplus=True,
                                       return_last_state=True)
    torch.testing.assert_close(out.cpu(), ref_out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(last.cpu(), ref_last, atol=2e-5, rtol=1e-4)
    for k, got in zip(NAMES, grads):
        scale = ref_grads[k].abs().max().item() + 1.0
        torch.testing.assert_close(got.cpu(), ref_grads[k], atol=2e-5 * scale, rtol=1e-4, msg=k)


# ---------------------------------------------------------------- bad input: clear errors, no launch
def _valid():
    return make_inputs(2, 4, 3, 8, None, device=KERNEL_DEVICE)


@pytest.mark.parametrize("change, exc, words", [
    (lambda x: x.update(u=x["u"][0]), ValueError, "u must have shape (b, d, l)"),
    (lambda x: x.update(delta=x["delta"][:, :, :5]), ValueError, "delta must have shape"),
    (lambda x: x.update(A=x["A"][:3]), ValueError, "A must have shape (d, n)"),
    (lambda x: x.update(B=x["B"][:1]), ValueError, "B must have shape"),
    (lambda x: x.update(C=x["C"][:, :2]), ValueError, "C must have shape"),
    (lambda x: x.update(D=torch.ones(3, device=KERNEL_DEVICE)), ValueError, "D must have shape (d,)"),
    (lambda x: x.update(z=x["z"][:1]), ValueError, "z must have shape"),
    (lambda x: x.update(delta_bias=torch.ones(4, 1, device=KERNEL_DEVICE)), ValueError, "delta_bias must have shape"),
    (lambda x: x.update(B=torch.randn(2, 3, 3, 8, device=KERNEL_DEVICE), C=torch.randn(2, 3, 3, 8, device=KERNEL_DEVICE)), ValueError, "must divide the channels"),
    (lambda x: x.update(u=x["u"].to(torch.int32)), TypeError, "u must have dtype"),
    (lambda x: x.update(A=torch.complex(x["A"], x["A"])), TypeError, "A must be real"),
    (lambda x: x.update(B=x["B"].cpu().numpy()), TypeError, "B must be a torch.Tensor"),
    (lambda x: x.update(D=x["D"].to("meta")), ValueError, "D is on meta"),
    (lambda x: x["delta"].__setitem__((0, 0, 0), math.nan), ValueError, "delta contains NaN"),
])
def test_bad_input_is_rejected_with_a_named_error(change, exc, words, monkeypatch):
    def no_launch(*a, **k):
        raise AssertionError("a kernel was launched for invalid input")
    monkeypatch.setattr(kernels, "selective_scan_fwd", no_launch)
    x = _valid()
    change(x)
    with pytest.raises(exc) as info:
        selective_scan(x["u"], x["delta"], x["A"], x["B"], x["C"], D=x["D"], z=x["z"], delta_bias=x["delta_bias"])
    assert words in str(info.value)



@pytest.mark.parametrize("constant", ["B", "C", "BC"])
def test_time_constant_B_or_C_matches_mamba_ssm_reference(constant):
    """B or C of shape (d, n), the same at every step, as mamba-ssm's selective_scan_fn takes them: forward and
    every gradient (dB, dC of shape (d, n), summed over b and l) against mamba-ssm's reference."""
    b, d, n, l = 2, 4, 3, 9
    inputs = make_inputs(b, d, n, l)
    gen = torch.Generator().manual_seed(2)
    for name in constant:   # "BC": both
        inputs[name] = torch.randn(d, n, generator=gen).to(KERNEL_DEVICE)
    dout = torch.randn(b, d, l, generator=torch.Generator().manual_seed(1)).to(KERNEL_DEVICE)
    out, _, grads = run(selective_scan, inputs, dout, delta_softplus=True)
    cpu_inputs = {k: (v.cpu() if v is not None else None) for k, v in inputs.items()}
    ref_out, _, ref_grads = run(oracle.selective_scan_ref(), cpu_inputs, dout.cpu(), delta_softplus=True)
    torch.testing.assert_close(out.cpu(), ref_out, atol=2e-5, rtol=1e-4)
    for k in ref_grads:
        scale = ref_grads[k].abs().max().item() + 1.0
        torch.testing.assert_close(grads[k].cpu(), ref_grads[k], atol=2e-5 * scale, rtol=1e-4, msg=k)
        assert grads[k].shape == inputs[k].shape

# ---------------------------------------------------------------- GPU only
@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_on_gpu(dtype):
    inputs = make_inputs(2, 64, 16, 300, None, dtype=dtype)
    dout = torch.randn(2, 64, 300, device="cuda", dtype=dtype)
    out, _, grads = run(selective_scan, inputs, dout, delta_softplus=True)
    f32 = {k: (v.float() if v is not None else None) for k, v in inputs.items()}
    ref_out, _, ref_grads = run(oracle.selective_scan_ref(), f32, dout.float(), delta_softplus=True)
    tol = 3e-2 if dtype == torch.bfloat16 else 5e-3
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref_out, atol=tol * ref_out.abs().max().item(), rtol=tol)
    for k in ref_grads:
        scale = ref_grads[k].abs().max().item()
        torch.testing.assert_close(grads[k].float(), ref_grads[k], atol=tol * scale, rtol=tol, msg=k)


@pytest.mark.gpu
@requires_gpu
def test_matches_mamba_ssm_cuda_kernel():
    if not oracle.cuda_extension_available():
        pytest.skip("mamba-ssm's CUDA extension is not built here")
    inputs = make_inputs(2, 64, 16, 257, None)
    dout = torch.randn(2, 64, 257, device="cuda")
    ours = run(selective_scan, inputs, dout, delta_softplus=True)
    theirs = run(oracle.selective_scan_fn(), inputs, dout, delta_softplus=True)
    torch.testing.assert_close(ours[0], theirs[0], atol=1e-4, rtol=1e-3)
    for k in theirs[2]:
        scale = theirs[2][k].abs().max().item()
        torch.testing.assert_close(ours[2][k], theirs[2][k], atol=1e-4 * scale, rtol=1e-3, msg=k)
