"""mambalab.ops.causal_conv1d_fn (its Triton kernels, mambalab.kernels.conv1d) against references: forward,
final states and every gradient (dx, dweight, dbias, dinitial_states) in fp32 and bf16, for contiguous and
channel-last x; packed sequences (seq_idx, padding); fewer positions than the window; gradients against a
float64 reference; a bitwise-repeatable backward whose dweight is sum_partials' fold of per-tile partials;
tile sizes that do not depend on the GPU; the errors it raises.

``causal_conv1d_ref`` below is the ``causal_conv1d`` package's reference, ported from Dao-AILab/causal-conv1d,
causal_conv1d/causal_conv1d_interface.py (Copyright (c) 2024, Tri Dao; BSD 3-Clause License): F.conv1d with
the initial states (or zeros) in front, computed in weight's dtype. Changed: ``final_states_out`` left out.
"""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mambalab import aot, device
from mambalab.determinism import emulate, fingerprint
from mambalab.kernels import conv1d as conv_kernels
from mambalab.kernels.reduce import fold_reference
from mambalab.modules.conv import causal_conv1d as module_causal_conv1d
from mambalab.ops import causal_conv1d_fn
from mambalab.ops import conv1d as conv1d_op
from mambalab.ops.conv1d import causal_conv_taps

from conftest import KERNEL_DEVICE, requires_gpu


def causal_conv1d_ref(x, weight, bias=None, initial_states=None, return_final_states=False, activation=None):
    """causal_conv1d's reference (module docstring)."""
    dtype_in = x.dtype
    x = x.to(weight.dtype)
    seqlen = x.shape[-1]
    dim, width = weight.shape
    if initial_states is None:
        out = F.conv1d(x, weight.unsqueeze(1), bias, padding=width - 1, groups=dim)
    else:
        x = torch.cat([initial_states.to(weight.dtype), x], dim=-1)
        out = F.conv1d(x, weight.unsqueeze(1), bias, padding=0, groups=dim)
    out = out[..., :seqlen]
    out = (out if activation is None else F.silu(out)).to(dtype=dtype_in)
    if not return_final_states:
        return out
    return out, F.pad(x, (width - 1 - x.shape[-1], 0)).to(dtype_in)


def leaves(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


def inputs(b, d, l, width, dtype, bias=True, init=False, seed=0, device=KERNEL_DEVICE):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, d, l, generator=gen).to(dtype)
    weight = torch.randn(d, width, generator=gen)              # fp32 weights, as causal_conv1d's tests
    bias_ = torch.randn(d, generator=gen) if bias else None
    init_ = torch.randn(b, d, width - 1, generator=gen).to(dtype) if init else None
    return [None if t is None else t.to(device) for t in (x, weight, bias_, init_)]


def grads(*tensors):
    return [None if t is None else t.grad for t in tensors]


TOL = {torch.float32: dict(rtol=3e-4, atol=1e-3), torch.bfloat16: dict(rtol=1e-2, atol=5e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("has_bias,has_init,final", [(True, False, False), (False, True, True), (True, True, True),
                                                     (True, False, True)])
def test_matches_reference(dtype, width, activation, has_bias, has_init, final):
    x, w, bias, init = inputs(2, 6, 9, width, dtype, bias=has_bias, init=has_init)
    ours = leaves(x, w, bias, init)
    ref = leaves(x, w, bias, init)
    out = causal_conv1d_fn(ours[0], ours[1], ours[2], initial_states=ours[3], return_final_states=final,
                           activation=activation)
    out_ref = causal_conv1d_ref(*ref, return_final_states=final, activation=activation)
    loss_terms = []
    if final:
        (out, fs), (out_ref, fs_ref) = out, out_ref
        assert fs.shape == (2, 6, width - 1) and fs.dtype == dtype
        torch.testing.assert_close(fs, fs_ref, rtol=0, atol=0)      # a copy of inputs: exact
        loss_terms = [torch.sigmoid(fs.float()).sum(), torch.sigmoid(fs_ref.float()).sum()]
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), out_ref.float(), **TOL[dtype])
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    ((out.float() * g.float()).sum() + (loss_terms[0] if final else 0)).backward()
    ((out_ref.float() * g.float()).sum() + (loss_terms[1] if final else 0)).backward()
    for name, got, want in zip(("dx", "dweight", "dbias", "dinitial_states"), grads(*ours), grads(*ref)):
        if want is None:
            assert got is None, name
            continue
        tol = dict(rtol=1e-3, atol=1e-3) if name in ("dweight", "dbias") else TOL[dtype]
        torch.testing.assert_close(got.float(), want.float(), **tol, msg=name)


@pytest.mark.parametrize("activation", [None, "swish"])
@pytest.mark.parametrize("width", [2, 4])
def test_float64_gradients(activation, width):
    """Our fp32 forward and gradients against the reference differentiated by autograd in float64."""
    x, w, bias, init = inputs(2, 5, 11, width, torch.float32, init=True, seed=3)
    ours = leaves(x, w, bias, init)
    ref = leaves(*(t.double() for t in (x, w, bias, init)))
    out, fs = causal_conv1d_fn(*ours[:3], initial_states=ours[3], return_final_states=True, activation=activation)
    out_ref, fs_ref = causal_conv1d_ref(*ref, return_final_states=True, activation=activation)
    torch.testing.assert_close(out.double(), out_ref, rtol=1e-6, atol=1e-6)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64).to(out.device)
    gf = torch.randn(fs.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(out.device)
    ((out.double() * g).sum() + (fs.double() * gf).sum()).backward()
    ((out_ref * g).sum() + (fs_ref * gf).sum()).backward()
    for name, got, want in zip(("dx", "dweight", "dbias", "dinitial_states"), grads(*ours), grads(*ref)):
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=name)


def packed(b, l, lengths_per_row, pad=0):
    """seq_idx (b, l) int32 with the given sequence lengths in each row, then ``pad`` positions of -1."""
    rows = []
    for lengths in lengths_per_row:
        assert sum(lengths) + pad == l
        row = torch.cat([torch.full((s,), i, dtype=torch.int32) for i, s in enumerate(lengths)]
                        + [torch.full((pad,), -1, dtype=torch.int32)])
        rows.append(row)
    return torch.stack(rows).to(KERNEL_DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [2, 4])
def test_seq_idx_matches_each_sequence_alone(dtype, width):
    """Packed sequences give, for each sequence, the reference on that sequence alone; gradients too."""
    lengths = [[3, 1, 8], [12]]
    x, w, bias, _ = inputs(2, 4, 12, width, dtype, seed=7)
    seq_idx = packed(2, 12, lengths)
    ours, ref = leaves(x, w, bias), leaves(x, w, bias)
    out = causal_conv1d_fn(*ours, seq_idx=seq_idx, activation="silu")
    out_ref = torch.cat([torch.cat([causal_conv1d_ref(part, ref[1], ref[2], activation="silu")
                                    for part in torch.split(ref[0][[i]], lengths[i], dim=2)], dim=2)
                         for i in range(2)])
    torch.testing.assert_close(out.float(), out_ref.float(), **TOL[dtype])
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(8)).to(out)
    (out.float() * g.float()).sum().backward()
    (out_ref.float() * g.float()).sum().backward()
    for name, got, want in zip(("dx", "dweight", "dbias"), grads(*ours), grads(*ref)):
        tol = dict(rtol=1e-3, atol=1e-3) if name != "dx" else TOL[dtype]
        torch.testing.assert_close(got.float(), want.float(), **tol, msg=name)


def test_seq_idx_padding_gives_zero():
    """Positions with a negative seq_idx are padding: output 0 and no gradient from them."""
    x, w, bias, _ = inputs(2, 3, 10, 3, torch.float32, seed=9)
    seq_idx = packed(2, 10, [[4, 3], [2, 5]], pad=3)
    xs = x.clone().requires_grad_()
    out = causal_conv1d_fn(xs, w, bias, seq_idx=seq_idx, activation="silu")
    assert torch.equal(out[..., 7:], torch.zeros_like(out[..., 7:]))
    torch.testing.assert_close(out[:1, :, :4], causal_conv1d_ref(x[:1, :, :4], w, bias, activation="silu"))
    out[..., 7:].sum().backward()    # only padding outputs: nothing reaches x
    assert torch.equal(xs.grad, torch.zeros_like(xs.grad))


def test_module_conv_uses_the_same_taps():
    """modules.conv.causal_conv1d with seq_idx (packed sequences) equals the op with activation silu."""
    conv = nn.Conv1d(6, 6, 4, groups=6, padding=3).to(KERNEL_DEVICE)
    x, *_ = inputs(2, 6, 10, 4, torch.float32, seed=10)
    seq_idx = packed(2, 10, [[5, 5], [1, 9]])
    with torch.no_grad():
        want = module_causal_conv1d(conv, x, seq_idx=seq_idx)
        got = causal_conv1d_fn(x, conv.weight[:, 0], conv.bias, seq_idx=seq_idx, activation="silu")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def reference64(x, w, bias, seq_idx, init, silu, final):
    """out (and the final states) in float64 from causal_conv_taps, with leaves for autograd: the kernels'
    reference. x, w, bias, init as given (None allowed), upcast; returns (leaves, out, final_states or None)."""
    leaves64 = [None if t is None else t.detach().double().requires_grad_() for t in (x, w, bias, init)]
    x64, w64, b64, i64 = leaves64
    out = causal_conv_taps(x64, w64, b64, seq_idx, i64)
    out = F.silu(out) if silu else out
    if seq_idx is not None:
        out = out.masked_fill((seq_idx < 0)[:, None], 0.0)
    states = None
    if final:
        width = w.shape[1]
        before = torch.zeros_like(x64[..., :width - 1]) if i64 is None else i64
        states = torch.cat([before, x64], dim=-1)[..., x64.shape[-1]:]            # the last width - 1 inputs
    return leaves64, out, states


def channel_last(x):
    """x (b, d, l) with the same values stored (b, l, d): as mamba-ssm passes xBC.transpose(1, 2)."""
    return x.transpose(1, 2).contiguous().transpose(1, 2)


KERNEL_CASES = {   # bias, activation, initial states and final states, packed sequences with padding
    "bias-silu-states": dict(bias=True, silu=True, init=True, final=True, packed=False),
    "plain-states": dict(bias=False, silu=False, init=True, final=True, packed=False),
    "bias-silu-packed": dict(bias=True, silu=True, init=False, final=False, packed=True),
}


def run_against_reference64(dtype, width, layout, case, b=2, d=3, l=70, seed=20):
    """The op (its Triton kernels) against :func:`reference64`: out, final states, dx, dweight, dbias and
    dinitial_states, with a gradient on the final states too."""
    c = KERNEL_CASES[case]
    x, w, bias, init = inputs(b, d, l, width, dtype, bias=c["bias"], init=c["init"], seed=seed)
    if layout == "channel_last":
        x = channel_last(x)
        init = None if init is None else channel_last(init)
    seq_idx = packed(b, l, [[1, 30, l - 39], [l - 8]], pad=8) if c["packed"] else None
    ours = leaves(x, w, bias, init)
    got = causal_conv1d_fn(ours[0], ours[1], ours[2], seq_idx=seq_idx, initial_states=ours[3],
                           return_final_states=c["final"], activation="silu" if c["silu"] else None)
    out, fs = got if c["final"] else (got, None)
    ref, out64, fs64 = reference64(x, w, bias, seq_idx, init, c["silu"], c["final"])
    assert out.dtype == dtype and out.stride() == x.stride()
    tol = TOL[dtype]
    torch.testing.assert_close(out.double(), out64, **tol)
    gen = torch.Generator().manual_seed(seed + 1)
    g = torch.randn(out.shape, generator=gen).to(dtype).to(out.device)
    loss, loss64 = (out.float() * g.float()).sum(), (out64 * g.double()).sum()
    if c["final"]:
        torch.testing.assert_close(fs.double(), fs64, rtol=0, atol=0)          # a copy of inputs: exact
        gf = torch.randn(fs.shape, generator=gen).to(dtype).to(out.device)
        loss, loss64 = loss + (fs.float() * gf.float()).sum(), loss64 + (fs64 * gf.double()).sum()
    loss.backward()
    loss64.backward()
    for name, got_, want in zip(("dx", "dweight", "dbias", "dinitial_states"), grads(*ours), grads(*ref)):
        if want is None:
            assert got_ is None, name
            continue
        if name == "dx":
            assert got_.stride() == x.stride(), "dx keeps x's layout"
        # dweight and dbias are fp32 sums of b · l products of the same inputs: fp32 accuracy in any dtype
        t = dict(rtol=1e-4, atol=1e-4) if name in ("dweight", "dbias") else tol
        torch.testing.assert_close(got_.double(), want, **t, msg=name)


@pytest.mark.parametrize("case", KERNEL_CASES)
@pytest.mark.parametrize("layout", ["contiguous", "channel_last"])
@pytest.mark.parametrize("width", [2, 3, 4])
def test_kernels_against_float64_reference(width, layout, case):
    """fp32, l = 70: two position blocks, the second partial."""
    run_against_reference64(torch.float32, width, layout, case)


@pytest.mark.parametrize("case", ["bias-silu-states", "bias-silu-packed"])
@pytest.mark.parametrize("layout", ["contiguous", "channel_last"])
def test_kernels_against_float64_reference_bf16(layout, case):
    run_against_reference64(torch.bfloat16, 4, layout, case)


@pytest.mark.parametrize("layout", ["contiguous", "channel_last"])
@pytest.mark.parametrize("l", [0, 2])
def test_kernels_with_fewer_positions_than_the_window(l, layout):
    """l < width - 1: the final states are partly (l = 2) or wholly (l = 0) the initial states, and their
    gradient flows back to both."""
    run_against_reference64(torch.float32, 4, layout, "bias-silu-states", l=l)
    run_against_reference64(torch.float32, 4, layout, "plain-states", l=l)


def test_backward_is_bitwise_repeatable_and_in_the_fixed_order():
    """Two backwards give the same bits; dweight and dbias are exactly sum_partials' fold (fold_reference: the
    same order in PyTorch) of the kernel's per-tile partials, one a (batch row, block of BLOCK_L positions),
    and those partials are the per-tile sums of dpre · x recomputed in PyTorch."""
    b, d, l, width = 11, 2, 2 * conv_kernels.BLOCK_L + 7, 2      # 11 · 3 = 33 partials: two segments of 32
    blocks = -(-l // conv_kernels.BLOCK_L)
    x, w, bias, _ = inputs(b, d, l, width, torch.float32, seed=11)
    g = torch.randn(b, d, l, generator=torch.Generator().manual_seed(12)).to(x)

    def backward_once():
        ours = leaves(x, w, bias)
        causal_conv1d_fn(*ours).backward(g)
        return grads(*ours)

    first, second = backward_once(), backward_once()
    for a, c in zip(first, second):
        assert torch.equal(a, c)
    _, _, partials = conv_kernels.causal_conv1d_bwd_partials(x, w, bias, None, None, g, None, False)
    assert partials.shape == (b * blocks, d, width + 1)
    folded = fold_reference(partials, 0)
    assert torch.equal(first[1], folded[:, :width]) and torch.equal(first[2], folded[:, width])
    # the partials from PyTorch, in float64: without an activation dpre = g; tap k reads x_{t - (width - 1) + k}
    xp = F.pad(x.double(), (width - 1, 0))
    per_position = torch.stack([g.double() * xp[..., k:k + l] for k in range(width)] + [g.double()], dim=-1)
    per_position = F.pad(per_position, (0, 0, 0, blocks * conv_kernels.BLOCK_L - l))   # (b, d, blocks · BLOCK_L, W + 1)
    tiles = per_position.reshape(b, d, blocks, conv_kernels.BLOCK_L, width + 1).sum(3)  # (b, d, blocks, W + 1)
    want = tiles.permute(0, 2, 1, 3).reshape(b * blocks, d, width + 1)
    torch.testing.assert_close(partials.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(folded.double(), fold_reference(want.float(), 0).double(), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not device.interpreter_active(), reason="records launches through Triton's interpreter")
def test_tile_sizes_do_not_depend_on_the_gpu():
    """The tile sizes are module-level ints, and the kernels' launches (every constexpr, num_warps) are the
    same whatever GPU the device layer reports: recorded, not run, under two profiles of other SM counts."""
    for name in ("BLOCK_L", "BLOCK_D", "NUM_WARPS", "FORWARD_BLOCK_L", "FORWARD_BLOCK_D", "FORWARD_NUM_WARPS",
                 "STATE_ROWS"):
        assert type(getattr(conv_kernels, name)) is int, name

    def run():
        x, w, bias, init = leaves(*inputs(2, 70, 100, 4, torch.bfloat16, init=True, seed=14))
        out, fs = causal_conv1d_fn(channel_last(x), w, bias, initial_states=init, return_final_states=True,
                                   activation="silu")
        torch.autograd.backward([out, fs], [torch.ones_like(out), torch.ones_like(fs)])

    with emulate("l4"):
        on_l4 = aot.record_launches(run)
    with emulate("h200"):
        on_h200 = aot.record_launches(run)
    names = {launch.name for launch in on_l4}
    assert {"causal_conv1d_fwd_kernel", "causal_conv1d_bwd_kernel"} <= names, names
    assert on_l4 == on_h200


def test_final_states_out_is_written():
    x, w, bias, init = inputs(2, 3, 2, 4, torch.float32, init=True, seed=13)   # l < width - 1
    buf = torch.full((2, 3, 3), float("nan"), device=KERNEL_DEVICE)
    out, fs = causal_conv1d_fn(x, w, bias, initial_states=init, return_final_states=True, final_states_out=buf)
    assert fs is buf
    torch.testing.assert_close(buf, torch.cat([init, x], dim=-1)[..., -3:], rtol=0, atol=0)


def test_refusals():
    x, w, bias, init = inputs(2, 4, 6, 3, torch.float32, init=True)
    seq_idx = packed(2, 6, [[6], [3, 3]])
    cases = [
        (dict(activation="relu"), ValueError, "activation"),
        (dict(seq_idx=seq_idx, initial_states=init), ValueError, "initial_states must be None"),
        (dict(seq_idx=seq_idx, return_final_states=True), ValueError, "return_final_states"),
        (dict(seq_idx=seq_idx.long()), TypeError, "seq_idx must be an int32"),
        (dict(seq_idx=seq_idx[:, :5]), ValueError, "seq_idx must have shape"),
        (dict(initial_states=init[..., :1]), ValueError, "initial_states must have shape"),
        (dict(initial_states=init.bfloat16()), TypeError, "initial_states must have x's dtype"),
        (dict(bias=bias[:3]), ValueError, "bias must have shape"),
        (dict(bias=bias.bfloat16()), TypeError, "bias must have weight's dtype"),
        (dict(weight=torch.randn(4, 5)), ValueError, "width"),
        (dict(weight=torch.randn(3, 3)), ValueError, "weight must have shape"),
        (dict(x=x[0]), ValueError, "x must have shape"),
        (dict(x=x.double()), TypeError, "x must have dtype"),
        (dict(return_final_states=True, final_states_out=torch.empty(2, 4, 3)), ValueError, "final_states_out"),
    ]
    for overrides, error, match in cases:
        kwargs = dict(x=x, weight=w, bias=bias) | overrides
        with pytest.raises(error, match=match):
            causal_conv1d_fn(**kwargs)


def test_refuses_more_partials_than_the_backward_sums_launch(monkeypatch):
    """b · cdiv(l, BLOCK_L) partials past 32 · 65,535 (CUDA's cap on grid axis 1, 32 partials a program) is
    refused when weight needs a gradient, before any computation; without one the forward is launched."""
    b = 32 * 65_535 + 1
    x = torch.zeros(b, 1, 1, device=KERNEL_DEVICE)
    weight = torch.ones(1, 2, device=KERNEL_DEVICE)
    with pytest.raises(ValueError, match=r"partials \(x.shape\[0\] · position blocks\) = 2,097,121 is too large"):
        causal_conv1d_fn(x, weight.requires_grad_())
    launched = []
    monkeypatch.setattr(conv1d_op, "causal_conv1d_fwd", lambda x, *a: launched.append(x.shape) or (x, None))
    with torch.no_grad():
        causal_conv1d_fn(x, weight)
    assert launched == [x.shape]


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_sizes(dtype):
    """At a block's size on the GPU: forward and gradients against the reference."""
    x, w, bias, init = inputs(2, 1536, 1024, 4, dtype, init=True, device="cuda")
    ours, ref = leaves(x, w, bias, init), leaves(x, w, bias, init)
    out = causal_conv1d_fn(*ours[:3], initial_states=ours[3], activation="silu")
    out_ref = causal_conv1d_ref(*ref, activation="silu")
    torch.testing.assert_close(out.float(), out_ref.float(), **TOL[dtype])
    g = torch.randn_like(out)
    out.backward(g)
    out_ref.backward(g)
    for name, got, want in zip(("dx", "dweight", "dbias", "dinitial_states"), grads(*ours), grads(*ref)):
        tol = dict(rtol=1e-3, atol=1e-2) if name in ("dweight", "dbias") else TOL[dtype]
        torch.testing.assert_close(got.float(), want.float(), **tol, msg=name)


@pytest.mark.gpu
@requires_gpu
def test_gpu_channel_last_upstream_sizes():
    """At causal_conv1d's benchmark sizes (b 2, d 4096, l 2048, bf16, channel-last x as mamba-ssm passes it):
    forward, final states and every gradient against the float64 reference; the backward's bits repeat."""
    b, d, l, width = 2, 4096, 2048, 4
    x, w, bias, init = inputs(b, d, l, width, torch.bfloat16, init=True, device="cuda")
    x, init = channel_last(x), channel_last(init)

    def run():
        ours = leaves(x, w, bias, init)
        out, fs = causal_conv1d_fn(*ours[:3], initial_states=ours[3], return_final_states=True, activation="silu")
        gen = torch.Generator(device="cuda").manual_seed(2)
        g = torch.randn(out.shape, generator=gen, device="cuda").to(out.dtype)
        gf = torch.randn(fs.shape, generator=gen, device="cuda").to(fs.dtype)
        torch.autograd.backward([out, fs], [g, gf])
        return ours, out, fs, g, gf

    ours, out, fs, g, gf = run()
    assert out.stride() == x.stride() and ours[0].grad.stride() == x.stride()
    ref, out64, fs64 = reference64(x, w, bias, None, init, True, True)
    torch.testing.assert_close(out.double(), out64, **TOL[torch.bfloat16])
    torch.testing.assert_close(fs.double(), fs64, rtol=0, atol=0)
    torch.autograd.backward([out64, fs64], [g.double(), gf.double()])
    for name, got, want in zip(("dx", "dweight", "dbias", "dinitial_states"), grads(*ours), grads(*ref)):
        tol = dict(rtol=1e-3, atol=1e-2) if name in ("dweight", "dbias") else TOL[torch.bfloat16]
        torch.testing.assert_close(got.double(), want, **tol, msg=name)
    again = grads(*run()[0])
    for name, a, c in zip(("dx", "dweight", "dbias", "dinitial_states"), grads(*ours), again):
        assert torch.equal(a, c), name


def test_a_channel_last_slice_gives_channel_last_out_and_dx():
    """mamba_split_conv1d_scan_combined passes xBC.transpose(1, 2), a channel-last slice of zxbcdt that is not
    dense: out and dx come back channel-last (their transpose(1, 2) contiguous, so the SSD's x, B and C need no
    copy) with the values of the same conv on a contiguous copy of x."""
    gen = torch.Generator().manual_seed(3)
    zxbcdt = torch.randn(2, 40, 3 * 16, generator=gen).to(KERNEL_DEVICE)
    x = zxbcdt[..., 16:32].transpose(1, 2).requires_grad_()             # (b, d, l), stride(1) == 1, not dense
    weight = torch.randn(16, 4, generator=gen).to(KERNEL_DEVICE)
    bias = torch.randn(16, generator=gen).to(KERNEL_DEVICE)
    out = causal_conv1d_fn(x, weight, bias, activation="silu")
    dout = torch.randn(out.shape, generator=gen).to(KERNEL_DEVICE)
    (dx,) = torch.autograd.grad(out, x, dout)
    assert out.transpose(1, 2).is_contiguous()
    x2 = x.detach().contiguous().requires_grad_()
    out2 = causal_conv1d_fn(x2, weight, bias, activation="silu")
    (dx2,) = torch.autograd.grad(out2, x2, dout)
    assert torch.equal(out, out2) and torch.equal(dx, dx2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_channels_convolved_apart_give_the_bits_of_one_conv(dtype):
    """The conv is depthwise, so mamba_split_conv1d_scan_combined convolves x, B and C apart: each channel's
    output, input gradient and weight and bias gradients must have the bits of one conv over all the channels
    (partials summed per channel, in an order that does not depend on its neighbours). 2 blocks of positions."""
    b, l, parts = 2, 100, (70, 16, 16)
    x, w, bias, _ = inputs(b, sum(parts), l, 4, dtype, seed=15)
    dout = torch.randn(b, sum(parts), l, generator=torch.Generator().manual_seed(16)).to(dtype).to(x.device)
    xs = channel_last(x)

    def step(pieces):
        xl, wl, bl = leaves(xs, w, bias)
        outs = [causal_conv1d_fn(xp, wp, bp, activation="silu") for xp, wp, bp in
                zip(*(t.split(pieces, dim=0 if t.dim() < 3 else 1) for t in (xl, wl, bl)))]
        out = torch.cat(outs, dim=1)
        out.backward(dout)
        return [out, xl.grad, wl.grad, bl.grad]

    for name, whole, apart in zip(("out", "dx", "dweight", "dbias"), step((sum(parts),)), step(parts)):
        assert fingerprint(whole) == fingerprint(apart), name
