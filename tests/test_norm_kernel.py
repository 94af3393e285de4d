"""mambalab.kernels.norm (the gated norm's forward as one Triton kernel, used for inference on a GPU) against
mambalab.modules.norm.layernorm_ref, the PyTorch form: RMS and LayerNorm modes, gate before or after, bias or none,
one group or several (of a size that is no power of two). On a GPU also: the modules under no_grad take the
kernel, and give the PyTorch form's values in bf16. The residual
form (add_norm: s = r + x, then the norm of s, one kernel) against PyTorch's add and the norm: s equal bit for
bit (the kernel rounds the sum as PyTorch's add does), the norm within the norm kernel's tolerance.

On the CPU the forward kernel runs in Triton's interpreter, in fp32, called directly (the modules take it for
inference on a GPU only).

The training kernels (norm_fwd with its saved statistics, norm_bwd) through layernorm_kernels (layernorm_fn on a GPU),
against layernorm_ref in float64: the forward and the gradients of x, z, weight and bias for RMS and LayerNorm,
with and without bias, z in both gate orders, one group and several, fp32 and bf16, M not a multiple of
ROWS_PER_PROGRAM. dweight and dbias: the same bits over two runs, and equal to sum_partials' fold of the
per-program partials recomputed here in PyTorch (ROWS_PER_PROGRAM rows a program, added in row order);
unchanged when the leading dimensions are regrouped. GPU tests at training sizes (M 16,384; d 2,048 and the
gated d 4,096 in one group, bf16)."""
import pytest
import torch

from mambalab.kernels import norm as norm_kernels
from mambalab.kernels.norm import ROWS_PER_PROGRAM, gated_norm_fwd, norm_bwd, norm_fwd
from mambalab.kernels.reduce import fold_reference
from mambalab.modules.norm import GatedLayerNorm, GatedRMSNorm, add_norm, layernorm_fn, layernorm_kernels, layernorm_ref

from conftest import KERNEL_DEVICE, requires_gpu


@pytest.mark.parametrize("is_rms_norm", [True, False])
@pytest.mark.parametrize("gated,norm_before_gate", [(False, True), (True, True), (True, False)])
@pytest.mark.parametrize("group_size,with_bias", [(48, False), (12, True)])
def test_kernel_matches_the_pytorch_form(is_rms_norm, gated, norm_before_gate, group_size, with_bias):
    gen = torch.Generator().manual_seed(0)
    x, z = (torch.randn(5, 48, generator=gen).to(KERNEL_DEVICE) * 3 for _ in range(2))
    weight = torch.randn(48, generator=gen).to(KERNEL_DEVICE)
    bias = torch.randn(48, generator=gen).to(KERNEL_DEVICE) if with_bias else None
    z = z if gated else None
    expect = layernorm_ref(x, weight, bias, z=z, eps=1e-5, group_size=group_size,
                           norm_before_gate=norm_before_gate, is_rms_norm=is_rms_norm)
    got = gated_norm_fwd(x, weight, bias, z, 1e-5, group_size, norm_before_gate, is_rms_norm)
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)


def test_rows_with_a_stride():
    """Rows further apart than d (a slice of a wider tensor, as the blocks split in_proj's output) are read at
    their stride."""
    wide = torch.randn(4, 80, device=KERNEL_DEVICE)
    x = wide[:, 16:48]                                                    # (4, 32), row stride 80
    weight = torch.rand(32, device=KERNEL_DEVICE) + 0.5
    got = gated_norm_fwd(x, weight, None, None, 1e-6, 32, True, True)
    expect = x / x.square().mean(-1, keepdim=True).add(1e-6).sqrt() * weight
    torch.testing.assert_close(got, expect, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_module_under_no_grad_takes_the_kernel(dtype, monkeypatch):
    """Mamba-2's gated norm at mamba2-2.7b's width (5,120 channels, one group), batch 64, one token."""
    import mambalab.modules.norm as norm_module
    calls = []
    kernel = norm_module.gated_norm_fwd
    monkeypatch.setattr(norm_module, "gated_norm_fwd", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    norm = GatedRMSNorm(5120, eps=1e-5, norm_before_gate=False, device="cuda", dtype=dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, z = (torch.randn(64, 1, 5120, device="cuda", dtype=dtype) for _ in range(2))
    with torch.no_grad():
        got = norm(x, z)
    assert calls == [1]
    expect = layernorm_ref(x, norm.weight, None, z=z, eps=1e-5, norm_before_gate=False, is_rms_norm=True)
    assert calls == [1]
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), expect.detach().float(), **tol)


@pytest.mark.parametrize("is_rms_norm", [True, False])
def test_residual_form_adds_then_normalises(is_rms_norm):
    gen = torch.Generator().manual_seed(1)
    x, r = (torch.randn(6, 40, generator=gen).to(KERNEL_DEVICE) for _ in range(2))
    weight = torch.randn(40, generator=gen).to(KERNEL_DEVICE)
    bias = None if is_rms_norm else torch.randn(40, generator=gen).to(KERNEL_DEVICE)
    out, s = gated_norm_fwd(x, weight, bias, None, 1e-5, 40, True, is_rms_norm, residual=r)
    assert torch.equal(s, r + x)
    expect = layernorm_ref(r + x, weight, bias, eps=1e-5, is_rms_norm=is_rms_norm)
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)


def test_add_norm_refuses_mismatched_shapes():
    norm = GatedRMSNorm(8)
    with pytest.raises(ValueError, match="residual and x must have one shape"):
        add_norm(norm, torch.zeros(2, 8), torch.zeros(1, 2, 8))


@pytest.mark.parametrize("dev", ["cpu", pytest.param("cuda", marks=(requires_gpu, pytest.mark.gpu))])
@pytest.mark.parametrize("grad", [False, True])
def test_add_norm_keeps_an_fp32_stream_over_a_bf16_update(dev, grad):
    """Under bf16 autocast a model's stream is fp32 (the embedding) and a mixer's output bf16: s is their fp32
    sum, not a refusal and not a bf16 rounding, and the norm is the norm of that sum (eagerly, on a GPU too)."""
    gen = torch.Generator().manual_seed(3)
    r = torch.randn(4, 5, 64, generator=gen).to(dev)
    x = torch.randn(4, 5, 64, generator=gen).to(dev, torch.bfloat16)
    norm = GatedRMSNorm(64, device=dev)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    with torch.set_grad_enabled(grad):
        s, out = add_norm(norm, r, x)
    expect_s = r + x.float()
    assert s.dtype == torch.float32 and torch.equal(s, expect_s)
    torch.testing.assert_close(out, layernorm_ref(expect_s, norm.weight, None, eps=1e-5, is_rms_norm=True).detach(),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("norm_cls", [GatedRMSNorm, GatedLayerNorm])
def test_gpu_add_norm_under_no_grad_is_one_kernel_with_pytorchs_sum(norm_cls, monkeypatch):
    """A language model's residual step at mamba2-2.7b's width, bf16, batch 64, one token: under no_grad one
    kernel call; the stream s bit for bit PyTorch's bf16 add, the norm close to the PyTorch form's."""
    import mambalab.modules.norm as norm_module
    calls = []
    kernel = norm_module.gated_norm_fwd
    monkeypatch.setattr(norm_module, "gated_norm_fwd", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    norm = norm_cls(2560, eps=1e-5, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    r, x = (torch.randn(64, 1, 2560, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with torch.no_grad():
        s, out = add_norm(norm, r, x)
    assert calls == [1]
    assert torch.equal(s, r + x)
    expect = layernorm_ref(r + x, norm.weight, norm.bias, eps=1e-5, is_rms_norm=norm.is_rms_norm).detach()
    assert calls == [1]
    torch.testing.assert_close(out.float(), expect.float(), atol=2e-2, rtol=2e-2)


# ------------------------------------------------------------------------------ training: forward and backward
def _train_inputs(shape, d, dtype, gated, with_bias, seed=0, device=KERNEL_DEVICE):
    gen = torch.Generator().manual_seed(seed)
    x, z, dy = (torch.randn(*shape, d, generator=gen) for _ in range(3))
    w = 1 + 0.5 * torch.randn(d, generator=gen)
    b = 0.3 * torch.randn(d, generator=gen) if with_bias else None
    cast = lambda t: None if t is None else t.to(device, dtype)
    return cast(x), cast(z) if gated else None, cast(w), cast(b), cast(dy)


def _forward_and_grads(fn, x, z, w, b, dy, **kw):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (x, z, w, b)]
    y = fn(leaves[0], leaves[2], leaves[3], z=leaves[1], **kw)
    y.backward(dy.to(y.dtype))
    return y.detach(), {name: t.grad for name, t in zip(("x", "z", "weight", "bias"), leaves) if t is not None}


def _kernels(x, weight, bias, z=None, eps=1e-6, group_size=None, norm_before_gate=True, is_rms_norm=False):
    """layernorm_kernels with layernorm_fn's keyword arguments (group_size None: one group)."""
    group_size = x.shape[-1] if group_size is None else group_size
    return layernorm_kernels(x, weight, bias, z, eps, group_size, norm_before_gate, is_rms_norm)


TRAIN_CASES = [   # (is_rms_norm, gate: None / "after" / "before", group_size of d = 48, bias)
    (True, None, 48, False),
    (True, "after", 48, True),
    (True, "before", 16, False),
    (False, None, 16, True),
    (False, "after", 16, False),
    (False, "before", 48, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", TRAIN_CASES,
                         ids=lambda c: f"{'rms' if c[0] else 'layer'}-z{c[1]}-g{c[2]}-b{int(c[3])}")
def test_training_kernels_match_float64_forward_and_every_gradient(case, dtype):
    """layernorm_kernels (layernorm_fn's training path on a GPU; on the CPU here in the interpreter) against
    layernorm_ref in float64 on the same (rounded) inputs: y, dx, dz, dweight, dbias. 70 rows: one program of
    64 and one of 6 in the backward. fp32 within 1e-4 (dweight sums 70 rows); bf16 within bf16's rounding of
    the output (2⁻⁸ relative) and of the inputs' gradients."""
    is_rms_norm, gate, group_size, with_bias = case
    assert 70 % ROWS_PER_PROGRAM
    x, z, w, b, dy = _train_inputs((7, 10), 48, dtype, gate is not None, with_bias)
    kw = dict(eps=1e-5, group_size=group_size, norm_before_gate=gate != "before", is_rms_norm=is_rms_norm)
    y, grads = _forward_and_grads(_kernels, x, z, w, b, dy, **kw)
    double = lambda t: None if t is None else t.double()
    y64, grads64 = _forward_and_grads(layernorm_ref, *map(double, (x, z, w, b, dy)), **kw)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    assert y.dtype == dtype and y.shape == x.shape
    torch.testing.assert_close(y.double(), y64, **tol)
    assert grads.keys() == grads64.keys()
    for name, g in grads.items():
        assert g.dtype == dtype, name
        # weight and bias sum 70 rows: bf16 rounds the sum once, at its magnitude
        scale = grads64[name].abs().max().item() if name in ("weight", "bias") else 1.0
        torch.testing.assert_close(g.double(), grads64[name], atol=tol["atol"] * scale, rtol=tol["rtol"],
                                   msg=lambda m: f"{name}: {m}")


def _program_partials(t: torch.Tensor) -> torch.Tensor:
    """(M, d) fp32 -> (P, d): each program's ROWS_PER_PROGRAM rows added one at a time in row order."""
    partials = []
    for first in range(0, t.shape[0], ROWS_PER_PROGRAM):
        acc = torch.zeros_like(t[0])
        for row in t[first:first + ROWS_PER_PROGRAM]:
            acc = acc + row
        partials.append(acc)
    return torch.stack(partials)


@pytest.mark.parametrize("is_rms_norm", [True, False])
def test_weight_and_bias_gradients_are_the_fold_of_per_program_partials(is_rms_norm):
    """dweight = Σ_rows dy ⊙ v̂ and dbias = Σ_rows dy, bit for bit the fold (sum_partials' order, checked
    against fold_reference) of per-program partials recomputed in PyTorch: ROWS_PER_PROGRAM rows a program
    in row order, v̂ from the forward's saved μ and σ⁻¹. 150 rows: three programs, the last of 22 rows; two
    groups of 24. The same bits on a second run. On a GPU the kernel's multiply-adds may fuse (one rounding
    where PyTorch has two), so there the recomputation is checked to fp32 rounding."""
    gen = torch.Generator().manual_seed(7)
    M, d, group_size = 150, 48, 24
    x, dy = (torch.randn(M, d, generator=gen).to(KERNEL_DEVICE) for _ in range(2))
    w, b = (torch.randn(d, generator=gen).to(KERNEL_DEVICE) for _ in range(2))
    runs = []
    for _ in range(2):
        _, _, mean, rstd = norm_fwd(x, w, b, None, None, 1e-5, group_size, True, is_rms_norm)
        dx, _, _, dw, db = norm_bwd(dy, None, x, None, w, b, mean, rstd, group_size, True, is_rms_norm,
                                    dx_dtype=torch.float32, want_db=True)
        runs.append((dx, dw, db, mean, rstd))
    assert all(torch.equal(a, c) for a, c in zip(runs[0][:3], runs[1][:3]))
    _, dw, db, mean, rstd = runs[0]
    expand = lambda stat: stat.repeat_interleave(group_size, dim=1)            # (M, G) -> (M, d)
    vhat = (x if is_rms_norm else x - expand(mean)) * expand(rstd)
    want_dw = fold_reference(_program_partials(dy * vhat), 0)
    want_db = fold_reference(_program_partials(dy), 0)
    assert _program_partials(dy).shape[0] == 3
    if KERNEL_DEVICE == "cpu":
        assert torch.equal(dw, want_dw) and torch.equal(db, want_db)
    else:
        torch.testing.assert_close(dw, want_dw, atol=1e-5, rtol=1e-5)
        assert torch.equal(db, want_db)


@pytest.mark.parametrize("gate", [None, "after", "before"])
def test_training_results_do_not_depend_on_how_the_rows_are_split(gate):
    """y and every gradient are the same bits for x of (60, d), (4, 15, d) and (2, 5, 6, d): the kernels see
    M = 60 rows whatever the leading dimensions."""
    x, z, w, b, dy = _train_inputs((60,), 32, torch.float32, gate is not None, True, seed=4)
    kw = dict(eps=1e-5, group_size=16, norm_before_gate=gate != "before", is_rms_norm=False)
    first = None
    for lead in [(60,), (4, 15), (2, 5, 6)]:
        shaped = lambda t: None if t is None else t.reshape(*lead, 32)
        y, grads = _forward_and_grads(_kernels, shaped(x), shaped(z), w, b, shaped(dy), **kw)
        got = [y.reshape(60, 32)] + [g.reshape(-1) for g in grads.values()]
        if first is None:
            first = got
        assert all(torch.equal(a, c) for a, c in zip(got, first)), lead


def test_on_the_cpu_layernorm_fn_is_the_pytorch_form(monkeypatch):
    """On the CPU layernorm_fn is layernorm_ref, with or without autograd recording (faster there than the
    interpreter): no kernel launches, the same bits."""
    calls = []
    for name in ("norm_fwd", "norm_bwd", "gated_norm_fwd"):
        kernel = getattr(norm_kernels, name)
        monkeypatch.setattr(f"mambalab.modules.norm.{name}", lambda *a, _k=kernel, **k: calls.append(1) or _k(*a, **k))
    x = torch.randn(3, 16)
    w = torch.ones(16)
    with torch.no_grad():
        assert torch.equal(layernorm_fn(x, w, None), layernorm_ref(x, w, None))
    w = w.clone().requires_grad_()
    y = layernorm_fn(x, w, None)
    y.sum().backward()
    assert torch.equal(y, layernorm_ref(x, w, None))
    assert calls == []


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("is_rms_norm", [True, False])
def test_gpu_gated_norm_training_at_mamba2_sizes(is_rms_norm):
    """Mamba-2's gated norm at d 4,096 in one group (ngroups 1), M 16,384 rows, bf16, the gate first: y and every
    gradient against layernorm_ref on the same inputs upcast to fp32; the weight's gradient the same bits twice."""
    x, z, w, b, dy = _train_inputs((4, 4096), 4096, torch.bfloat16, True, not is_rms_norm, device="cuda")
    w = w.float()
    b = b.float() if b is not None else None
    kw = dict(eps=1e-5, group_size=4096, norm_before_gate=False, is_rms_norm=is_rms_norm)
    y, grads = _forward_and_grads(layernorm_fn, x, z, w, b, dy, **kw)
    _, again = _forward_and_grads(layernorm_fn, x, z, w, b, dy, **kw)
    assert torch.equal(grads["weight"], again["weight"])
    up = lambda t: None if t is None else t.float()
    y32, grads32 = _forward_and_grads(layernorm_ref, *map(up, (x, z, w, b, dy)), **kw)
    torch.testing.assert_close(y.float(), y32, atol=2e-2, rtol=2e-2)
    for name, g in grads.items():
        scale = grads32[name].abs().max().item()
        tol = dict(atol=1e-3 * scale, rtol=1e-3) if name in ("weight", "bias") else dict(atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(g.float(), grads32[name], **tol, msg=lambda m: f"{name}: {m}")
