"""mambalab.ops.layer_norm_fn / rms_norm_fn against mamba-ssm's: the same signatures; the forward and every
gradient against mamba-ssm's PyTorch references (``layer_norm_ref`` / ``rms_norm_ref``, upcast) with the
tolerance rule of mamba-ssm's and flash-attention's layer-norm tests (the error at most twice that of the
reference run in the input's dtype, plus an atol); against float64 autograd (fp32 and bf16, every residual and
prenorm case); a backward that repeats bit for bit, sums db as sum_partials' fold of per-program partials in
row order, gives the same bits for any split of the rows and under an emulated RTX 4090 and RTX A6000 without
reading the SM count; the unimplemented arguments refused before any computation. GPU tests: against
mamba-ssm's Triton kernels, whose weight gradients follow the emulated SM count where ours do not; at a
training size (M 16,384, N 2,048, bf16) against the fp32 reference."""
import inspect

import pytest
import torch
import torch.nn.functional as F

from mambalab import oracle
from mambalab.determinism import emulate, fingerprint
from mambalab.kernels import norm as ln_kernels
from mambalab.kernels.reduce import fold_reference
from mambalab.ops import layer_norm as ln_mod
from mambalab.ops import layer_norm_fn, rms_norm_fn

from conftest import KERNEL_DEVICE, requires_gpu
from test_determinism_kernels import mambalab_property_reads

upstream = oracle.module("ops.triton.layer_norm")

N = 80                 # channels: more than one segment of sum_partials (32), not a power of two
SHAPE = (4, 40, N)     # 160 rows: the column sums fold in two levels too

# (residual: None / "x" (x's dtype) / "fp32", prenorm, residual_in_fp32, has_bias, weight in fp32)
CASES = [
    (None, False, False, True, True),
    (None, True, True, False, True),
    (None, True, False, True, False),
    ("x", True, False, True, False),
    ("fp32", True, False, False, True),
    ("x", False, True, True, True),
]


def make(dtype, residual, has_bias, weight_fp32, shape=SHAPE, seed=0, device=KERNEL_DEVICE):
    gen = torch.Generator().manual_seed(seed)
    n = shape[-1]
    wtype = torch.float32 if weight_fp32 else dtype
    x = torch.randn(*shape, generator=gen).to(device, dtype)
    w = (1 + 0.5 * torch.randn(n, generator=gen)).to(device, wtype)
    b = (0.3 * torch.randn(n, generator=gen)).to(device, wtype) if has_bias else None
    rtype = {None: None, "x": dtype, "fp32": torch.float32}[residual]
    r = torch.randn(*shape, generator=gen).to(device, rtype) if rtype is not None else None
    dy = torch.randn(*shape, generator=gen).to(device, dtype)
    ds = torch.randn(*shape, generator=gen).to(device)
    return x, w, b, r, dy, ds


def leaves(*ts):
    return [None if t is None else t.detach().clone().requires_grad_() for t in ts]


def run(fn, x, w, b, r, dy, ds, prenorm, **kw):
    """Forward and backward of fn; returns (y, s or None, grads of x, w, b, r)."""
    x, w, b, r = leaves(x, w, b, r)
    out = fn(x, w, b, residual=r, prenorm=prenorm, **kw)
    y, s = out if prenorm else (out, None)
    loss = (y.float() * dy.float()).sum()
    if prenorm:
        loss = loss + (s.float() * ds.to(s.device)).sum()
    loss.backward()
    return y.detach(), None if s is None else s.detach(), [None if t is None else t.grad for t in (x, w, b, r)]


def maxerr(a, b):
    return (a.float() - b.float()).abs().max().item()


# ------------------------------------------------------------------------------------------------ the signature
@pytest.mark.parametrize("name", ["layer_norm_fn", "rms_norm_fn"])
def test_signature_is_mamba_ssm_s(name):
    ours, theirs = inspect.signature(getattr(ln_mod, name)), inspect.signature(getattr(upstream, name))
    assert [(p.name, p.default, p.kind) for p in ours.parameters.values()] == \
           [(p.name, p.default, p.kind) for p in theirs.parameters.values()]


# ---------------------------------------------------------------------------- against mamba-ssm's references
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"res{c[0]}-pre{int(c[1])}-fp32res{int(c[2])}-bias{int(c[3])}"
                                                      f"-w32{int(c[4])}")
@pytest.mark.parametrize("is_rms_norm", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_mamba_ssm_reference(dtype, is_rms_norm, case):
    """Output, s, and the gradients of x, weight, bias and residual against mamba-ssm's reference in fp32
    (upcast=True): our error is at most twice the error of the reference run in the inputs' own dtypes, plus
    an atol (5e-2 with bf16 anywhere, else 1e-4), the rule of mamba-ssm's and flash-attention's layer-norm
    tests. s is x + residual formed in fp32 and rounded once to the stream's dtype."""
    residual, prenorm, residual_in_fp32, has_bias, weight_fp32 = case
    x, w, b, r, dy, ds = make(dtype, residual, has_bias, weight_fp32)
    ref = upstream.rms_norm_ref if is_rms_norm else upstream.layer_norm_ref
    fn = rms_norm_fn if is_rms_norm else layer_norm_fn
    kw = dict(eps=1e-5, residual_in_fp32=residual_in_fp32)
    y, s, grads = run(fn, x, w, b, r, dy, ds, prenorm, **kw)
    y_ref, s_ref, grads_ref = run(ref, x, w, b, r, dy, ds, prenorm, eps=1e-5, upcast=True)
    y_pt, _, grads_pt = run(ref, x, w, b, r, dy, ds, prenorm, eps=1e-5)
    atol = 5e-2 if torch.bfloat16 in (x.dtype, w.dtype, None if r is None else r.dtype) else 1e-4

    assert y.dtype == x.dtype and y.shape == x.shape
    assert maxerr(y, y_ref) <= 2 * maxerr(y_pt, y_ref) + atol
    if prenorm:
        stream = r.dtype if r is not None else (torch.float32 if residual_in_fp32 else x.dtype)
        assert s.dtype == stream and s.shape == x.shape
        assert torch.equal(s, s_ref.to(stream))
    names = ("x", "weight", "bias", "residual")
    for name, g, g_ref, g_pt, t in zip(names, grads, grads_ref, grads_pt, (x, w, b, r)):
        if t is None:
            assert g is None
            continue
        assert g.dtype == t.dtype and g.shape == t.shape, name
        assert maxerr(g, g_ref) <= 2 * maxerr(g_pt, g_ref) + atol, name


FLOAT64_CASES = [   # (shape, x's dtype, residual, residual_in_fp32, prenorm, bias)
    ((N,), torch.float32, "x", False, True, True),
    ((7, 33), torch.float32, "x", False, True, True),
    ((2, 3, 5, 16), torch.float32, None, True, True, False),
    ((70, 24), torch.float32, "fp32", False, True, True),
    ((70, 24), torch.bfloat16, "fp32", False, True, True),
    ((70, 24), torch.bfloat16, "x", False, True, False),
    ((70, 24), torch.bfloat16, None, True, True, True),
    ((70, 24), torch.bfloat16, None, False, False, True),
]


@pytest.mark.parametrize("case", FLOAT64_CASES, ids=lambda c: f"{'x'.join(map(str, c[0]))}-{str(c[1])[6:]}-res{c[2]}"
                                                              f"-fp32res{int(c[3])}-pre{int(c[4])}-bias{int(c[5])}")
@pytest.mark.parametrize("is_rms_norm", [False, True])
def test_matches_float64_autograd(case, is_rms_norm):
    """The kernels against the same math in float64 with PyTorch's autograd on the same (rounded) inputs, for
    any leading shape (70 rows: not a multiple of the backward's 64 rows a program): y, s and every gradient,
    a residual of x's dtype or fp32 or none, residual_in_fp32, prenorm with a gradient on s, bias or none; fp32
    and bf16. s is the fp32 sum rounded once to the stream's dtype; bf16 outputs within bf16's rounding."""
    shape, dtype, residual, residual_in_fp32, prenorm, has_bias = case
    x, w, b, r, dy, ds = make(dtype, residual, has_bias, True, shape=shape, seed=3)
    y, s, grads = run(layer_norm_fn, x, w, b, r, dy, ds, prenorm, eps=1e-5, is_rms_norm=is_rms_norm,
                      residual_in_fp32=residual_in_fp32)

    x64, w64, b64, r64 = leaves(*(None if t is None else t.double() for t in (x, w, b, r)))
    s64 = x64 if r64 is None else x64 + r64
    if is_rms_norm:
        y64 = s64 / torch.sqrt(s64.square().mean(-1, keepdim=True) + 1e-5) * w64
        y64 = y64 if b64 is None else y64 + b64
    else:
        y64 = F.layer_norm(s64, shape[-1:], w64, b64, 1e-5)
    loss = (y64 * dy.double()).sum()
    if prenorm:
        loss = loss + (s64 * ds.double()).sum()
    loss.backward()

    stream = r.dtype if r is not None else (torch.float32 if residual_in_fp32 else dtype)
    if prenorm:
        assert s.dtype == stream
        assert torch.equal(s, s64.detach().to(stream))
    low = dtype == torch.bfloat16
    tol = dict(atol=2e-2, rtol=1e-2) if low else dict(atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(y.double(), y64.detach(), **tol)
    for name, g, t, t64 in zip(("x", "weight", "bias", "residual"), grads, (x, w, b, r), (x64, w64, b64, r64)):
        if t is None:
            assert g is None
            continue
        assert g.dtype == t.dtype, name
        g_tol = tol if t.dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-5)
        if low and t.dtype != torch.bfloat16:   # fp32 sums over rows; the backward's ŝ comes from the stored s,
            # which a bf16 stream has rounded (as mamba-ssm's backward reads it)
            rel = 1e-2 if stream == torch.bfloat16 and r is not None else 1e-4
            g_tol = dict(atol=rel * t64.grad.abs().max().item(), rtol=rel)
        torch.testing.assert_close(g.double(), t64.grad, **g_tol, msg=name)


# ------------------------------------------------------------------------------------------------- determinism
def fingerprints(fn, inputs, prenorm=True, **kw):
    y, s, grads = run(fn, *inputs, prenorm, **kw)
    return fingerprint([y, s]), fingerprint(grads)


def program_partials(t):
    """(M, N) fp32 -> (P, N): each backward program's ROWS_PER_PROGRAM rows added one at a time in row order."""
    rows = ln_kernels.ROWS_PER_PROGRAM
    partials = []
    for first in range(0, t.shape[0], rows):
        acc = torch.zeros_like(t[0])
        for row in t[first:first + rows]:
            acc = acc + row
        partials.append(acc)
    return torch.stack(partials)


@pytest.mark.parametrize("is_rms_norm", [False, True])
def test_backward_repeats_and_sums_rows_in_the_fixed_order(is_rms_norm):
    """Two runs give the same bits; db is bit for bit the fold (sum_partials' order) of per-program partials of
    dy's rows, ROWS_PER_PROGRAM rows a program in row order (160 rows: three programs, the last of 32): the
    order is fixed by the number of rows alone. fp32 cotangents: sums of bf16 numbers are often exact in any
    order."""
    inputs = make(torch.float32, "fp32", True, True)
    first = fingerprints(layer_norm_fn, inputs, eps=1e-5, is_rms_norm=is_rms_norm)
    assert fingerprints(layer_norm_fn, inputs, eps=1e-5, is_rms_norm=is_rms_norm) == first
    _, _, grads = run(layer_norm_fn, *inputs, True, eps=1e-5, is_rms_norm=is_rms_norm)
    partials = program_partials(inputs[4].reshape(-1, N).float())
    assert partials.shape[0] == 3
    assert torch.equal(grads[2], fold_reference(partials, 0))


@pytest.mark.parametrize("is_rms_norm", [False, True])
def test_same_bits_for_any_split_of_the_rows(is_rms_norm):
    """y, s and every gradient are the same bits for x of (4, 40, N), (160, N) and (8, 5, 4, N): 160 rows each."""
    inputs = make(torch.bfloat16, "fp32", True, True, seed=2)
    first = None
    for lead in [(4, 40), (160,), (8, 5, 4)]:
        shaped = [t if k in (1, 2) else t.reshape(*lead, N) for k, t in enumerate(inputs)]   # all but w, b
        y, s, grads = run(layer_norm_fn, *shaped, True, eps=1e-5, is_rms_norm=is_rms_norm)
        got = [y.reshape(-1, N), s.reshape(-1, N)] + [g.reshape(-1) for g in grads]
        first = first or got
        assert all(torch.equal(a, c) for a, c in zip(got, first)), lead


def test_same_bits_on_an_emulated_rtx4090_and_rtxa6000():
    """Under emulate() (in force: the SM count torch reports is the profile's) the forward and every gradient
    give one fingerprint on an RTX 4090 (128 SMs) and an RTX A6000 (84 SMs), and nothing in mambalab asks torch
    for the device's properties."""
    inputs = make(torch.bfloat16, "fp32", True, True, seed=1)
    seen = {}
    for key, sms in (("rtx4090", 128), ("rtxa6000", 84)):
        with emulate(key), mambalab_property_reads() as readers:
            assert torch.cuda.get_device_properties(inputs[0].device).multi_processor_count == sms
            seen[key] = (fingerprints(layer_norm_fn, inputs, eps=1e-5),
                         fingerprints(rms_norm_fn, inputs, eps=1e-5))
        assert readers == [], f"mambalab read the device's properties in {sorted(set(readers))}"
    assert seen["rtx4090"] == seen["rtxa6000"]


# ------------------------------------------------------------------------------------------------ refusals
REFUSED = [
    ("dropout_p", dict(dropout_p=0.1)),
    ("rowscale", dict(rowscale="rows")),
    ("x1", dict(x1="x")),
    ("weight1", dict(weight1="w")),
    ("bias1", dict(bias1="w")),
    ("return_dropout_mask", dict(return_dropout_mask=True)),
]


@pytest.mark.parametrize("fn", [layer_norm_fn, rms_norm_fn], ids=["layer_norm_fn", "rms_norm_fn"])
@pytest.mark.parametrize("name,kw", REFUSED, ids=[r[0] for r in REFUSED])
def test_refuses_unimplemented_arguments_before_computing(monkeypatch, fn, name, kw):
    """Each unimplemented argument raises a ValueError naming it and saying why, before the autograd function
    runs."""
    x, w, b, r, _, _ = make(torch.float32, "x", True, True, shape=(3, 8))
    values = {"rows": torch.ones(3), "x": x.clone(), "w": w.clone()}
    kw = {k: values.get(v, v) if isinstance(v, str) else v for k, v in kw.items()}

    def never(*args, **kwargs):
        raise AssertionError("computed before refusing")

    monkeypatch.setattr(ln_mod.LayerNormFn, "apply", never)
    with pytest.raises(ValueError, match=rf"^{name} must .*does not implement it"):
        fn(x, w, b, residual=r, **kw)


@pytest.mark.parametrize("args,kw,error,match", [
    ((torch.randn(3, 8), torch.randn(7), None), {}, ValueError, r"weight must have shape \(N,\)"),
    ((torch.randn(3, 8), torch.randn(8), torch.randn(4)), {}, ValueError, r"bias must have shape \(N,\)"),
    ((torch.randn(3, 8), torch.randn(8), None), dict(residual=torch.randn(3, 9)), ValueError,
     r"residual must have shape"),
    ((torch.randn(3, 8, dtype=torch.float64), torch.randn(8), None), {}, TypeError, r"x must have dtype"),
    ((torch.randn(3, 0), torch.randn(0), None), {}, ValueError, r"x must have shape \(\.\.\., N\) with N >= 1"),
    ((torch.randn(3, 8), torch.randn(8), None), dict(eps=-1.0), ValueError, r"eps must be"),
])
def test_rejects_bad_inputs(args, kw, error, match):
    with pytest.raises(error, match=match):
        layer_norm_fn(*(None if a is None else a.to(KERNEL_DEVICE) for a in args),
                      **{k: v.to(KERNEL_DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kw.items()})


# ------------------------------------------------------------------------------------------------ GPU
@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("case", CASES[2:5])
@pytest.mark.parametrize("is_rms_norm", [False, True])
def test_matches_mamba_ssm_triton_kernels(is_rms_norm, case):
    """On a GPU, against mamba-ssm's own fused Triton layer norm (bf16): output, s and gradients within the
    reference rule of the test above (each error at most twice mamba-ssm's own plus 5e-2)."""
    residual, prenorm, residual_in_fp32, has_bias, weight_fp32 = case
    x, w, b, r, dy, ds = make(torch.bfloat16, residual, has_bias, weight_fp32, shape=(8, 512, 1024), device="cuda")
    kw = dict(eps=1e-5, residual_in_fp32=residual_in_fp32, is_rms_norm=is_rms_norm)
    y, s, grads = run(layer_norm_fn, x, w, b, r, dy, ds, prenorm, **kw)
    y_up, s_up, grads_up = run(upstream.layer_norm_fn, x, w, b, r, dy, ds, prenorm, **kw)
    ref = upstream.rms_norm_ref if is_rms_norm else upstream.layer_norm_ref
    y_ref, _, grads_ref = run(ref, x, w, b, r, dy, ds, prenorm, eps=1e-5, upcast=True)
    assert maxerr(y, y_ref) <= 2 * maxerr(y_up, y_ref) + 5e-2
    if prenorm:
        assert torch.equal(s, s_up)
    for g, g_up, g_ref in zip(grads, grads_up, grads_ref):
        if g is not None:
            assert maxerr(g, g_ref) <= 2 * maxerr(g_up, g_ref) + 5e-2


@pytest.mark.gpu
@requires_gpu
def test_mamba_ssm_weight_grads_follow_the_sm_count_where_ours_do_not():
    """On a GPU: under an emulated RTX 4090 and RTX A6000, mamba-ssm's dweight (summed over sm_count per-program
    partials) takes two bit patterns; ours one, for the same inputs."""
    x, w, b, r, dy, ds = make(torch.bfloat16, "fp32", True, True, shape=(4, 1024, 1024), device="cuda")
    ours, theirs = set(), set()
    for key in ("rtx4090", "rtxa6000"):
        with emulate(key):
            ours.add(fingerprint(run(layer_norm_fn, x, w, b, r, dy, ds, True, eps=1e-5)[2][1]))
            theirs.add(fingerprint(run(upstream.layer_norm_fn, x, w, b, r, dy, ds, True, eps=1e-5)[2][1]))
    assert len(ours) == 1 and len(theirs) == 2


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("is_rms_norm", [False, True])
def test_training_size_against_the_fp32_reference(is_rms_norm):
    """M 16,384 rows (b 4, l 4,096) of N 2,048, bf16 x with an fp32 residual stream and prenorm (mamba-ssm's
    MixerModel with residual_in_fp32): y, s and every gradient against mamba-ssm's reference upcast to fp32, by
    the rule of test_matches_mamba_ssm_reference; the weight's gradient the same bits twice."""
    x, w, b, r, dy, ds = make(torch.bfloat16, "fp32", True, True, shape=(4, 4096, 2048), device="cuda")
    kw = dict(eps=1e-5, is_rms_norm=is_rms_norm)
    y, s, grads = run(layer_norm_fn, x, w, b, r, dy, ds, True, **kw)
    assert torch.equal(run(layer_norm_fn, x, w, b, r, dy, ds, True, **kw)[2][1], grads[1])
    ref = upstream.rms_norm_ref if is_rms_norm else upstream.layer_norm_ref
    y_ref, s_ref, grads_ref = run(ref, x, w, b, r, dy, ds, True, eps=1e-5, upcast=True)
    y_pt, _, grads_pt = run(ref, x, w, b, r, dy, ds, True, eps=1e-5)
    assert torch.equal(s, s_ref.to(s.dtype))
    assert maxerr(y, y_ref) <= 2 * maxerr(y_pt, y_ref) + 5e-2
    for name, g, g_ref, g_pt in zip(("x", "weight", "bias", "residual"), grads, grads_ref, grads_pt):
        assert maxerr(g, g_ref) <= 2 * maxerr(g_pt, g_ref) + 5e-2, name
