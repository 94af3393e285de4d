"""mambalab.modules.norm: GatedRMSNorm and GatedLayerNorm against mamba-ssm's ``layernorm_gated`` (its reference
``rms_norm_ref`` for values and gradients, fp64 and fp32, every combination of groups, gate order, gate and bias;
a float64 group-wise ``F.layer_norm`` for the LayerNorm mode), mamba-ssm's constructor and functional signatures
and defaults, per-group independence, and a weight gradient that is bitwise the same however the leading
dimensions are split and however often it is computed."""
import inspect

import pytest
import torch
import torch.nn.functional as F

from mambalab import oracle
from mambalab.modules import GatedLayerNorm, GatedRMSNorm, LayerNormGated, RMSNormGated
from mambalab.modules import norm as norm_module

D = 16


def layernorm_gated():
    return oracle.module("ops.triton.layernorm_gated")


def inputs(dtype, seed=0, shape=(3, 5)):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, D, generator=gen, dtype=dtype)
    z = torch.randn(*shape, D, generator=gen, dtype=dtype)
    # weight and bias exactly representable in fp32: the reference casts them to fp32
    weight = (torch.rand(D, generator=gen) + 0.5).to(dtype)
    bias = (0.1 * torch.randn(D, generator=gen)).to(dtype)
    return x, z, weight, bias


def forward_and_grads(fn, x, z, weight, bias):
    """fn(x, z, weight, bias) and the gradients of the tensors given (None skipped) for a fixed, varied dy."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (x, z, weight, bias)]
    y = fn(*leaves)
    y.backward(torch.cos(torch.arange(y.numel(), dtype=y.dtype)).reshape(y.shape))
    return y.detach(), [t.grad for t in leaves if t is not None]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("group_size", [None, D // 2], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("norm_before_gate", [True, False], ids=["norm-then-gate", "gate-then-norm"])
@pytest.mark.parametrize("gated", [True, False], ids=["z", "no-z"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
def test_gated_rmsnorm_matches_mamba_ssm_reference_forward_and_backward(dtype, group_size, norm_before_gate, gated,
                                                                        with_bias):
    x, z, weight, bias = inputs(dtype)
    z = z if gated else None
    bias = bias if with_bias else None
    rms_norm_ref = layernorm_gated().rms_norm_ref
    # fp64: the reference without its fp32 upcast computes in fp64; fp32: as mamba-ssm runs it.
    upcast = dtype != torch.float64
    want, want_grads = forward_and_grads(
        lambda x, z, w, b: rms_norm_ref(x, w, b, z=z, eps=1e-5, group_size=group_size,
                                        norm_before_gate=norm_before_gate, upcast=upcast), x, z, weight, bias)

    norm = GatedRMSNorm(D, eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate, dtype=dtype,
                        bias=with_bias)

    got, got_grads = forward_and_grads(
        lambda x, z, w, b: norm_module.rmsnorm_fn(x, w, b, z=z, eps=1e-5, group_size=group_size,
                                                  norm_before_gate=norm_before_gate), x, z, weight, bias)
    tol = dict(atol=1e-12, rtol=1e-12) if dtype == torch.float64 else dict(atol=2e-6, rtol=2e-5)
    torch.testing.assert_close(got, want, **tol)
    # The reference casts weight and bias to fp32 (weight.float()), so their gradients reach fp32 precision only.
    param_tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float64 else tol
    names = [name for name, t in zip(("x", "z", "weight", "bias"), (x, z, weight, bias)) if t is not None]
    for name, g, w in zip(names, got_grads, want_grads):
        torch.testing.assert_close(g, w, **(tol if name in ("x", "z") else param_tol), msg=lambda m: f"{name}: {m}")

    # the module computes what the function does, with its own parameters
    with torch.no_grad():
        norm.weight.copy_(weight)
        if with_bias:
            norm.bias.copy_(bias)
        torch.testing.assert_close(norm(x, z), want, **tol)


@pytest.mark.parametrize("group_size", [None, D // 4], ids=["one-group", "four-groups"])
@pytest.mark.parametrize("norm_before_gate", [True, False], ids=["norm-then-gate", "gate-then-norm"])
def test_gated_layernorm_matches_a_float64_group_layer_norm(group_size, norm_before_gate):
    """mamba-ssm's LayerNorm mode has no PyTorch reference of its own; F.layer_norm over each group in fp64 is
    one. Values and gradients, fp32 against fp64."""
    x, z, weight, bias = inputs(torch.float64, seed=3)
    size = group_size or D

    def reference(x, z, w, b):
        v = x if norm_before_gate else x * F.silu(z)
        y = F.layer_norm(v.unflatten(-1, (D // size, size)), (size,), eps=1e-5).flatten(-2) * w + b
        return y * F.silu(z) if norm_before_gate else y

    want, want_grads = forward_and_grads(reference, x, z, weight, bias)
    norm = GatedLayerNorm(D, eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate)
    with torch.no_grad():
        norm.weight.copy_(weight.float())
        norm.bias.copy_(bias.float())
    fp32 = [t.float() for t in (x, z, weight, bias)]
    got, got_grads = forward_and_grads(
        lambda x, z, w, b: norm_module.layernorm_fn(x, w, b, z=z, eps=1e-5, group_size=group_size,
                                                    norm_before_gate=norm_before_gate), *fp32)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-5)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g.double(), w, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(norm(x.float(), z.float()).double(), want, atol=2e-6, rtol=2e-5)


@pytest.mark.parametrize("ours, theirs", [(GatedRMSNorm, "RMSNorm"), (GatedLayerNorm, "LayerNorm")])
def test_constructor_arguments_defaults_and_state_dict_are_mamba_ssm_s(ours, theirs):
    upstream = getattr(layernorm_gated(), theirs)
    positional = lambda cls: [(p.name, p.default) for p in inspect.signature(cls.__init__).parameters.values()
                              if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert positional(ours) == positional(upstream)      # names, order and defaults (norm_before_gate=True)
    extra = [p for p in inspect.signature(ours.__init__).parameters.values() if p.kind is not p.POSITIONAL_OR_KEYWORD]
    assert all(p.kind is p.KEYWORD_ONLY for p in extra)
    a, b = ours(D, group_size=D // 2), upstream(D, group_size=D // 2)
    assert {k: v.shape for k, v in a.state_dict().items()} == {k: v.shape for k, v in b.state_dict().items()}
    assert (a.bias is None) == (b.bias is None) and a.norm_before_gate is b.norm_before_gate is True
    assert a.group_size == b.group_size and a.eps == b.eps
    b.load_state_dict(a.state_dict())
    for name in ("rmsnorm_fn", "layernorm_fn"):
        assert (inspect.signature(getattr(norm_module, name)).parameters.keys()
                == inspect.signature(getattr(layernorm_gated(), name)).parameters.keys())
    assert RMSNormGated is GatedRMSNorm and LayerNormGated is GatedLayerNorm


def test_groups_are_independent_and_each_has_unit_rms():
    """Changing one group's inputs changes that group's outputs only; with the gate first and weight 1 each
    group of the output has unit RMS."""
    gen = torch.Generator().manual_seed(0)
    norm = GatedRMSNorm(24, group_size=8, norm_before_gate=False)
    x, z = torch.randn(3, 24, generator=gen), torch.randn(3, 24, generator=gen)
    x2, z2 = x.clone(), z.clone()
    x2[:, 8:16] = 10 * torch.randn(3, 8, generator=gen)
    z2[:, 8:16] = torch.randn(3, 8, generator=gen)
    with torch.no_grad():
        y, y2 = norm(x, z), norm(x2, z2)
    assert torch.equal(y[:, :8], y2[:, :8]) and torch.equal(y[:, 16:], y2[:, 16:])
    assert not torch.allclose(y[:, 8:16], y2[:, 8:16])
    rms = y.unflatten(-1, (3, 8)).square().mean(-1).sqrt()
    torch.testing.assert_close(rms, torch.ones(3, 3), atol=1e-3, rtol=0)  # eps shifts it slightly


@pytest.mark.parametrize("cls", [GatedRMSNorm, GatedLayerNorm])
def test_weight_gradient_is_bitwise_the_same_for_any_split_of_the_rows_and_every_run(cls):
    """The weight's gradient sums over all rows; it is the same bits whether the 48 rows come as (48,),
    (4, 12) or (8, 6), and on every repetition: no reduction whose order depends on the shape's split, the
    run or the machine's SM count."""
    gen = torch.Generator().manual_seed(5)
    x, z, dy = (torch.randn(48, D, generator=gen) for _ in range(3))
    norm = cls(D, group_size=D // 2)

    def weight_grad(shape):
        norm.zero_grad()
        norm(x.reshape(*shape, D), z.reshape(*shape, D)).backward(dy.reshape(*shape, D))
        return norm.weight.grad.clone()

    first = weight_grad((48,))
    for shape in [(4, 12), (8, 6), (2, 4, 6), (48,)]:
        assert torch.equal(weight_grad(shape), first), shape


def test_bad_arguments_fail_clearly():
    with pytest.raises(ValueError, match="group_size must divide hidden_size = 24"):
        GatedRMSNorm(24, group_size=5)
    norm = GatedRMSNorm(24)
    with pytest.raises(ValueError, match="hidden_size = 24"):
        norm(torch.zeros(2, 23))
    with pytest.raises(ValueError, match="z must have x's shape"):
        norm(torch.zeros(2, 24), torch.zeros(3, 24))
    assert norm(torch.zeros(2, 24, dtype=torch.bfloat16)).dtype == torch.bfloat16
