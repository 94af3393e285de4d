"""mambalab.ops.decode_linear (a batch-1 linear layer as one Triton GEMV, with the gated RMS norm before it or
the causal conv's step after it) against mambalab.ref.decode_linear's PyTorch reference: plain, with a bias,
the norm in one group or several, gated before or after, with a residual stream, the conv on a channel range
that starts and ends inside the kernel's row blocks; Mamba-2's fused batch-1 step against its other paths and
against the whole-sequence forward; bad input named before any launch. On a GPU also: mamba2-2.7b's shapes in
bf16, and Mamba2.step taking the fused path.

On the CPU the kernel runs in Triton's interpreter, in fp32: its inner roundings to bf16 (the norm's output, the
conv's new input) do not happen there while the reference's do, so the bf16 cases compare at bf16's tolerance;
a language model's decode takes the fused path on the CPU only with the GPU test of
:func:`mambalab.device.inference_kernels_apply` lifted."""
import pytest
import torch

from mambalab.determinism import ARCH_PROFILES, emulate, fingerprint
from mambalab.kernels.gemv import gemv_config
from mambalab.modules.mamba2 import Mamba2
from mambalab.modules.norm import GatedRMSNorm, add_norm
from mambalab.ops.decode_linear import decode_linear
from mambalab.ref.decode_linear import decode_linear_ref

from conftest import KERNEL_DEVICE, requires_gpu
from test_determinism_kernels import mambalab_property_reads, program_order

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def rand(*shape, dtype=torch.float32, device=KERNEL_DEVICE, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


def layer(n, k, dtype=torch.float32, device=KERNEL_DEVICE):
    """x (1, K), W (N, K) scaled as a trained layer's (outputs of order one), bias (N,)."""
    return (rand(1, k, dtype=dtype, device=device, seed=1), rand(n, k, dtype=dtype, device=device, seed=2,
                                                                 scale=k ** -0.5),
            rand(n, dtype=dtype, device=device, seed=3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [True, False])
def test_plain_matches_reference(dtype, with_bias):
    x, weight, bias = layer(300, 1100, dtype)     # 300 rows: the last block partial; K: three k tiles, one partial
    bias = bias if with_bias else None
    torch.testing.assert_close(decode_linear(x, weight, bias), decode_linear_ref(x, weight, bias), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size", [None, 40])
@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("gated,with_residual", [(True, False), (False, True), (True, True)])
def test_norm_prologue_matches_reference(dtype, group_size, norm_before_gate, gated, with_residual):
    """The gated RMS norm before the GEMV (K = 600: groups of 40 cross the k tiles' edges), with a residual
    stream whose sum comes back once."""
    x, weight, _ = layer(70, 600, dtype)
    norm = dict(norm_weight=rand(600, dtype=dtype, seed=4).abs() + 0.5,
                z=rand(1, 600, dtype=dtype, seed=5) if gated else None,
                residual=rand(1, 600, dtype=dtype, seed=6) if with_residual else None,
                group_size=group_size, norm_before_gate=norm_before_gate)
    got, expect = decode_linear(x, weight, **norm), decode_linear_ref(x, weight, **norm)
    if with_residual:
        torch.testing.assert_close(got[1], expect[1], atol=0, rtol=0)     # one add, rounded once
        got, expect = got[0], expect[0]
    torch.testing.assert_close(got, expect, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width,with_bias", [(4, True), (3, False), (2, True)])
def test_conv_epilogue_matches_reference(dtype, width, with_bias):
    """The conv's step on outputs 13 to 13 + 250 of 300 (the range starts and ends inside row blocks): those
    outputs leave through the conv, the others as the GEMV gave them; the windows move exactly."""
    x, weight, bias = layer(300, 96, dtype)
    state = rand(250, width, dtype=dtype, seed=7)
    conv = dict(conv_weight=rand(250, width, dtype=dtype, seed=8),
                conv_bias=rand(250, dtype=dtype, seed=9) if with_bias else None, conv_start=13)
    mine, theirs = state.clone(), state.clone()
    got = decode_linear(x, weight, bias, conv_state=mine, **conv)
    expect = decode_linear_ref(x, weight, bias, conv_state=theirs, **conv)
    torch.testing.assert_close(got, expect, **TOL[dtype])
    torch.testing.assert_close(mine, theirs, **TOL[dtype])
    torch.testing.assert_close(mine[:, :-1], state[:, 1:], atol=0, rtol=0)   # the old inputs, moved


def test_same_bits_under_every_emulated_gpu_and_program_order():
    """The tiles, and so the order of every sum, come from the shape alone: under each emulated GPU (its SM
    count among its properties) and a shuffled program order the fused GEMVs give one bit pattern, and nothing
    in mambalab asks for the device's properties."""
    x, weight, bias = layer(300, 600)
    norm = dict(norm_weight=rand(600, seed=4), z=rand(1, 600, seed=5), residual=rand(1, 600, seed=6), group_size=200)
    conv = dict(conv_weight=rand(250, 4, seed=8), conv_bias=rand(250, seed=9), conv_start=13)
    state = rand(250, 4, seed=7)

    def prints():
        out, s = decode_linear(x, weight, bias, **norm)
        window = state.clone()
        return (fingerprint(out), fingerprint(s), fingerprint(decode_linear(x, weight, bias, conv_state=window, **conv)),
                fingerprint(window))

    runs = {"plain": prints()}
    for seed, key in enumerate(ARCH_PROFILES):
        with emulate(key), program_order(seed), mambalab_property_reads() as readers:
            runs[key] = prints()
        assert readers == [], f"mambalab read the device's properties in {sorted(set(readers))}"
    assert len(set(runs.values())) == 1, runs
    assert gemv_config(2560, 5120).block_k == 1024 and gemv_config(300, 96).block_k == 128   # K < the tile


def fused_block(dtype, ngroups=2):
    torch.manual_seed(0)
    return Mamba2(64, d_state=16, headdim=16, ngroups=ngroups, layer_idx=0).to(device=KERNEL_DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_step_matches_the_step_and_the_forward(dtype):
    """Mamba2's batch-1 step in three kernels (called directly here: step takes it on a GPU) gives the
    unfused step's outputs and states token by token, and the whole-sequence forward's outputs."""
    block = fused_block(dtype)
    u = rand(1, 6, 64, dtype=dtype, seed=10)
    with torch.no_grad():
        whole = block(u)
        conv, ssm = block.allocate_inference_cache(1, 6, dtype=dtype)
        conv2, ssm2 = conv.clone(), ssm.clone()
        fused = []
        for t in range(6):
            out, *_ = block._fused_step(u[:, t:t + 1], conv, ssm)
            expect, *_ = block.step(u[:, t:t + 1], conv2, ssm2)
            torch.testing.assert_close(out, expect, **TOL[dtype])
            fused.append(out)
    torch.testing.assert_close(conv, conv2, **TOL[dtype])
    torch.testing.assert_close(ssm, ssm2, atol=1e-3 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    torch.testing.assert_close(torch.cat(fused, dim=1), whole, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_step_with_the_pre_norm_matches_add_norm_then_the_step(dtype):
    """A language model's block at batch 1: the residual add and the block's RMS norm inside in_proj's GEMV give
    add_norm's stream and the step's output (the first block: the norm of h alone)."""
    block = fused_block(dtype)
    norm = GatedRMSNorm(64).to(device=KERNEL_DEVICE, dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(rand(64, dtype=dtype, seed=11).abs() + 0.5)
        conv, ssm = block.allocate_inference_cache(1, 4, dtype=dtype)
        conv2, ssm2 = conv.clone(), ssm.clone()
        for t in range(4):
            h, update = rand(1, 1, 64, dtype=dtype, seed=12 + t), rand(1, 1, 64, dtype=dtype, seed=20 + t)
            update = None if t == 0 else update
            s, out = block._fused_step(h, conv, ssm, norm=norm, update=update)
            s2, normed = (h, norm(h)) if update is None else add_norm(norm, h, update)
            out2, *_ = block.step(normed, conv2, ssm2)
            torch.testing.assert_close(s, s2, atol=0, rtol=0)
            torch.testing.assert_close(out, out2, **TOL[dtype])


def test_language_model_decode_through_the_fused_blocks_gives_the_forward(monkeypatch):
    """MambaLM past its prompt at batch 1, with the inference kernels let onto the CPU: every block takes
    add_norm_step's fused path (the residual add and the block's norm in in_proj's GEMV), and the (h, update)
    pairs it hands on give the whole-sequence forward's logits."""
    from mambalab import device
    from mambalab.inference import InferenceParams
    from mambalab.modules.lm import LMConfig, MambaLM

    torch.manual_seed(0)
    model = MambaLM(LMConfig(vocab_size=64, d_model=64, n_layer=2, headdim=16, ngroups=2)).to(KERNEL_DEVICE)
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(1)).to(KERNEL_DEVICE)
    calls = []
    fused_step = Mamba2._fused_step
    monkeypatch.setattr(Mamba2, "_fused_step", lambda self, *a, **k: calls.append(k) or fused_step(self, *a, **k))
    with torch.no_grad():
        whole = model(ids)
        params = InferenceParams(max_seqlen=5, max_batch_size=1)
        stepped = [model(ids[:, :2], inference_params=params)]
        monkeypatch.setattr(device, "inference_kernels_apply",
                            lambda x, *others: x.dtype != torch.float64 and not device.records_autograd(x, *others))
        for t in range(2, 5):
            params.seqlen_offset = t
            stepped.append(model(ids[:, t:t + 1], inference_params=params))
    assert len(calls) == 3 * 2 and all(k["norm"] is not None for k in calls)
    assert [k["update"] is None for k in calls] == [True, False] * 3       # block 0 reads the embedding alone
    torch.testing.assert_close(torch.cat(stepped, dim=1), whole, atol=1e-4, rtol=1e-4)


def test_fused_step_applies_at_batch_one_without_autograd_only():
    block = fused_block(torch.float32)
    one, two = torch.zeros(1, 1, 64, device=KERNEL_DEVICE), torch.zeros(2, 1, 64, device=KERNEL_DEVICE)
    with torch.no_grad():
        assert block._fused_step_applies(one) and not block._fused_step_applies(two)
        assert not fused_block(torch.bfloat16)._fused_step_applies(one)          # weights of another dtype
    assert not block._fused_step_applies(one)                                   # autograd would record it
    from mambalab.parallel.layout import single_process_layout
    from mambalab.parallel.mamba2 import TensorParallelMamba2
    sharded = TensorParallelMamba2(64, single_process_layout(), d_state=16, headdim=16, ngroups=2)
    with torch.no_grad():                       # its projections all-reduce across ranks: never fused
        assert not sharded.to(KERNEL_DEVICE)._fused_step_applies(one)


def test_bad_input_is_named():
    x, weight, bias = layer(20, 32)
    state = rand(8, 4)
    before = state.clone()
    cases = [
        (dict(x=x.expand(2, 32)), ValueError, r"x must have shape \(1, K\)"),
        (dict(weight=weight[:, :31]), ValueError, r"weight must have shape \(N, K\) with K = 32"),
        (dict(bias=bias[:19]), ValueError, r"bias must have shape \(N,\)"),
        (dict(z=x), ValueError, "pass norm_weight with them"),
        (dict(norm_weight=rand(32), group_size=5), ValueError, "group_size must divide K = 32"),
        (dict(norm_weight=rand(32), z=x[:, :16]), ValueError, r"z must have shape \(1, K\)"),
        (dict(conv_state=state), ValueError, "conv_weight"),
        (dict(conv_state=state, conv_weight=rand(8, 4), conv_start=13), ValueError,
         r"conv_start must be an int in \[0, N - channels\] = \[0, 12\]"),
        (dict(conv_state=state, conv_weight=rand(8, 3)), ValueError, r"conv_weight must have shape"),
        (dict(weight=weight.clone().requires_grad_()), NotImplementedError, "no_grad"),
        (dict(x=x.to(torch.int32)), TypeError, "x must have dtype"),
    ]
    for change, error, message in cases:
        args = dict(x=x, weight=weight, bias=bias) | change
        with pytest.raises(error, match=message):
            decode_linear(args.pop("x"), args.pop("weight"), args.pop("bias"), **args)
    assert torch.equal(state, before)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("n,k,fused", [(10576, 2560, "conv"), (2560, 5120, "norm")])
def test_gpu_bf16_at_mamba2_2_7b_shapes(n, k, fused):
    """mamba2-2.7b's in_proj with the conv (5,376 channels, width 4) and its out_proj with the gated norm (one
    group of 5,120), in bf16: within bf16 rounding of the reference; bit for bit over repeated calls."""
    x, weight, _ = layer(n, k, torch.bfloat16, "cuda")
    if fused == "conv":
        state = rand(5376, 4, dtype=torch.bfloat16, device="cuda", seed=7)
        extra = dict(conv_weight=rand(5376, 4, dtype=torch.bfloat16, device="cuda", seed=8),
                     conv_bias=rand(5376, dtype=torch.bfloat16, device="cuda", seed=9), conv_start=5120)
        runs = [decode_linear(x, weight, conv_state=state.clone(), **extra) for _ in range(3)]
        expect = decode_linear_ref(x, weight, conv_state=state.clone(), **extra)
    else:
        extra = dict(norm_weight=rand(k, dtype=torch.bfloat16, device="cuda", seed=4).abs() + 0.5,
                     z=rand(1, k, dtype=torch.bfloat16, device="cuda", seed=5), norm_before_gate=False)
        runs = [decode_linear(x, weight, **extra) for _ in range(3)]
        expect = decode_linear_ref(x, weight, **extra)
    assert all(torch.equal(r, runs[0]) for r in runs)
    torch.testing.assert_close(runs[0], expect, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@requires_gpu
def test_gpu_step_takes_the_fused_path_at_batch_one():
    """On a GPU, Mamba2.step at batch 1 launches three kernels (two GEMVs and the state update), and its
    outputs over a sequence are the forward's."""
    block = fused_block(torch.bfloat16)
    u = rand(1, 5, 64, dtype=torch.bfloat16, device="cuda", seed=10)
    with torch.no_grad():
        whole = block(u)
        conv, ssm = block.allocate_inference_cache(1, 5, dtype=torch.bfloat16)
        block.step(u[:, :1], conv, ssm)    # compiled once before counting
        conv.zero_(), ssm.zero_()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            steps = [block.step(u[:, t:t + 1], conv, ssm)[0] for t in range(5)]
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("gemv_kernel" in n for n in names) == 10 and sum("state_update_kernel" in n for n in names) == 5
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
@requires_gpu
def test_gpu_language_model_decodes_in_three_kernels_a_block():
    """A MambaLM past its prompt at batch 1: each block's add, norm and step run as two GEMVs and the state
    update (only norm_f's add-norm stays a norm kernel), and the stepped logits are the whole-sequence ones."""
    from mambalab.inference import InferenceParams
    from mambalab.modules.lm import LMConfig, MambaLM

    torch.manual_seed(0)
    model = MambaLM(LMConfig(vocab_size=64, d_model=64, n_layer=3, headdim=16, ngroups=2),
                    device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 64, (1, 6), device="cuda")
    with torch.no_grad():
        whole = model(ids)
        warm = InferenceParams(max_seqlen=6, max_batch_size=1)
        model(ids[:, :2], inference_params=warm)
        warm.seqlen_offset = 2
        model(ids[:, 2:3], inference_params=warm)           # the kernels compiled before counting
        params = InferenceParams(max_seqlen=6, max_batch_size=1)
        stepped = [model(ids[:, :2], inference_params=params)]
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for t in range(2, 6):
                params.seqlen_offset = t
                stepped.append(model(ids[:, t:t + 1], inference_params=params))
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("gemv_kernel" in n for n in names) == 4 * 3 * 2
    assert sum("norm_fwd_kernel" in n for n in names) == 4                     # norm_f, once a token
    torch.testing.assert_close(torch.cat(stepped, dim=1).float(), whole.float(), atol=5e-2, rtol=5e-2)
