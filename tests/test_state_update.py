"""mambalab.ops.selective_state_update (the Mamba-1/Mamba-2 decode step, one Triton kernel) against
mambalab.ref.state_update and against mamba-ssm's own ``selective_state_update_ref``: both of mamba-ssm's
forms (with and without heads), per-head Δ and A broadcast with stride 0 (Mamba-2), groups, D, z, dt_bias,
softplus, dt_limit, state_batch_indices with a padding row, A given as A_log (A_is_log); bad input named before
any launch. On a GPU also:
bf16 at the size mamba2-2.7b decodes at batch 64, against the reference and mamba-ssm's Triton kernel.

On the CPU the kernel runs in Triton's interpreter, in fp32."""
import pytest
import torch

from mambalab import oracle
from mambalab.ops.state_update import selective_state_update
from mambalab.ref.state_update import selective_state_update_ref

from conftest import KERNEL_DEVICE, requires_gpu


def mamba2_inputs(b, h, p, n, g, dtype=torch.float32, device=KERNEL_DEVICE, seed=0):
    """Mamba-2's decode-step arguments: Δ, A, D and dt_bias one per head, expanded over (p, n) with stride 0."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(device)
    return dict(state=r(b, h, p, n).to(dtype), x=r(b, h, p).to(dtype), dt=r(b, h)[..., None].expand(b, h, p).to(dtype),
                A=(-torch.rand(h, generator=gen).to(device) * 4)[:, None, None].expand(h, p, n),
                B=r(b, g, n).to(dtype), C=r(b, g, n).to(dtype), D=r(h)[:, None].expand(h, p),
                z=r(b, h, p).to(dtype), dt_bias=r(h)[:, None].expand(h, p) - 2.0)


def mamba1_inputs(b, d, n, device=KERNEL_DEVICE, seed=1):
    """Mamba-1's: no head axis; Δ and A per channel (A per channel and state dimension)."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen).to(device)
    return dict(state=r(b, d, n), x=r(b, d), dt=r(b, d), A=-torch.rand(d, n, generator=gen).to(device) * 3,
                B=r(b, n), C=r(b, n), D=r(d), z=r(b, d), dt_bias=r(d) - 2.0)


def run_both(inputs, **kw):
    """(out, state) through the kernel and through the reference, each on its own copy of the state."""
    s_kernel, s_ref = inputs["state"].clone(), inputs["state"].clone()
    rest = {k: v for k, v in inputs.items() if k != "state"}
    out_kernel = selective_state_update(s_kernel, **rest, **kw)
    out_ref = selective_state_update_ref(s_ref, **rest, **kw)
    return (out_kernel, s_kernel), (out_ref, s_ref)


@pytest.mark.parametrize("drop", [(), ("D",), ("z",), ("dt_bias",), ("D", "z", "dt_bias")])
@pytest.mark.parametrize("softplus,limit", [(True, None), (True, (0.01, 0.3)), (False, None)])
def test_mamba2_form_matches_reference(drop, softplus, limit):
    inputs = mamba2_inputs(3, 4, 8, 16, 2)
    for name in drop:
        inputs[name] = None
    if not softplus:   # Δ must be positive without the softplus
        inputs["dt"] = inputs["dt"].abs() * 0.1
    (out, state), (out_ref, state_ref) = run_both(inputs, dt_softplus=softplus, dt_limit=limit)
    assert out.shape == (3, 4, 8) and out.dtype == inputs["x"].dtype
    torch.testing.assert_close(state, state_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    assert not torch.equal(state, inputs["state"])   # the state moved


def test_per_channel_and_per_head_paths_agree():
    """The same step with Δ and A materialised per (dim, n) takes the general path: same numbers."""
    inputs = mamba2_inputs(2, 4, 8, 16, 1)
    (out, state), _ = run_both(inputs, dt_softplus=True)
    dense = {k: (v.contiguous() if v is not None else None) for k, v in inputs.items()}
    (out_dense, state_dense), _ = run_both(dense, dt_softplus=True)
    torch.testing.assert_close(out, out_dense, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(state, state_dense, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("form", ["mamba1", "mamba2"])
def test_a_given_as_its_log_gives_the_same_step(form):
    """A_is_log=True with the blocks' parameter A_log equals the step with A = -exp(A_log) formed outside, in both
    forms (per channel and state dimension; one per head, broadcast with stride 0)."""
    inputs = mamba1_inputs(2, 8, 16) if form == "mamba1" else mamba2_inputs(2, 4, 8, 16, 2)
    A_log = torch.log(-inputs["A"])                                   # keeps the broadcast strides
    (out, state), _ = run_both(inputs, dt_softplus=True)
    s_log = inputs["state"].clone()
    rest = {k: v for k, v in inputs.items() if k not in ("state", "A")}
    out_log = selective_state_update(s_log, A=A_log, **rest, dt_softplus=True, A_is_log=True)
    torch.testing.assert_close(s_log, state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out_log, out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", [False, True])
def test_matches_mamba_ssm_reference(heads):
    """mamba-ssm's own selective_state_update_ref (its reference for its Triton kernel), both forms."""
    ref = oracle.module("ops.triton.selective_state_update").selective_state_update_ref
    inputs = mamba2_inputs(2, 4, 8, 16, 2) if heads else mamba1_inputs(2, 12, 16)
    theirs_state = inputs["state"].clone()
    rest = {k: v for k, v in inputs.items() if k != "state"}
    theirs = ref(theirs_state, **rest, dt_softplus=True)
    state = inputs["state"].clone()
    ours = selective_state_update(state, **rest, dt_softplus=True)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, theirs_state, atol=1e-5, rtol=1e-5)


def test_state_batch_indices_pick_rows_and_skip_padding():
    inputs = mamba2_inputs(3, 2, 4, 16, 1)
    pool = torch.randn(5, 2, 4, 16, device=KERNEL_DEVICE)           # more state rows than batch rows
    index = torch.tensor([4, -1, 1], dtype=torch.int32, device=KERNEL_DEVICE)
    rest = {k: v for k, v in inputs.items() if k != "state"}
    updated = pool.clone()
    out = selective_state_update(updated, **rest, dt_softplus=True, state_batch_indices=index)
    for row, picked in ((0, 4), (2, 1)):
        alone = pool[picked:picked + 1].clone()
        expect = selective_state_update_ref(alone, **{k: (v[row:row + 1] if v is not None and v.shape[0] == 3
                                                              and k not in ("A", "D", "dt_bias") else v)
                                                      for k, v in rest.items()}, dt_softplus=True)
        torch.testing.assert_close(out[row], expect[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(updated[picked], alone[0], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1], torch.zeros_like(out[1]))             # the padding row: zero output
    for untouched in (0, 2, 3):                                       # rows no batch row picked
        assert torch.equal(updated[untouched], pool[untouched])


def test_bad_input_is_named():
    inputs = mamba2_inputs(2, 4, 8, 16, 2)
    rest = lambda **over: {**{k: v for k, v in inputs.items() if k != "state"}, **over}
    state = inputs["state"].clone()
    with pytest.raises(ValueError, match=r"x must have shape \(b, h, dim\)"):
        selective_state_update(state, **rest(x=inputs["x"][:, :, :5]))
    with pytest.raises(ValueError, match="B must have shape .* g dividing h = 4"):
        selective_state_update(state, **rest(B=torch.randn(2, 3, 16, device=KERNEL_DEVICE)))
    with pytest.raises(ValueError, match="state_batch_indices"):
        selective_state_update(torch.zeros(5, 4, 8, 16, device=KERNEL_DEVICE), **rest())
    with pytest.raises(TypeError, match="state_batch_indices must have dtype"):
        selective_state_update(state, **rest(), state_batch_indices=torch.zeros(2, device=KERNEL_DEVICE))
    with pytest.raises(ValueError, match="dt_limit"):
        selective_state_update(state, **rest(), dt_limit=(1.0, 0.5))
    with pytest.raises(NotImplementedError, match="no_grad"):
        selective_state_update(state, **rest(x=inputs["x"].clone().requires_grad_()))
    assert torch.equal(state, inputs["state"])   # nothing was written by a refused call


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_decode_size_matches_reference_and_mamba_ssm(dtype):
    """mamba2-2.7b's layer at batch 64 (h 80, p 64, n 128, one group), the fp32 state a model keeps, inputs in
    ``dtype``: against the fp32 reference, and against mamba-ssm's Triton kernel run on the same inputs."""
    kernel = oracle.module("ops.triton.selective_state_update").selective_state_update
    inputs = mamba2_inputs(64, 80, 64, 128, 1, dtype=dtype, device="cuda")
    inputs["state"] = inputs["state"].float()
    (out, state), (out_ref, state_ref) = run_both(inputs, dt_softplus=True)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(state, state_ref, **tol)
    torch.testing.assert_close(out.float(), out_ref.float(), **tol)
    theirs_state = inputs["state"].clone()
    theirs = kernel(theirs_state, **{k: v for k, v in inputs.items() if k != "state"}, dt_softplus=True)
    torch.testing.assert_close(out.float(), theirs.float(), **tol)
    torch.testing.assert_close(state, theirs_state, **tol)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("layer", ["Mamba1", "Mamba2"])
def test_gpu_block_step_kernels_match_the_pytorch_step(layer):
    """A block's decode step under no_grad on a GPU (the Triton kernels: A from A_log inside the state update, the
    conv update, the gated norm) against the same step while autograd records (the PyTorch form), fp32, three
    steps from zeroed states: outputs and states agree."""
    from mambalab.modules import Mamba1, Mamba2
    torch.manual_seed(0)
    block = (Mamba1(64, d_state=16) if layer == "Mamba1"
             else Mamba2(64, d_state=32, headdim=16, ngroups=2, chunk_size=16)).cuda()
    kernel_states = block.allocate_inference_cache(3)
    torch_states = tuple(t.clone() for t in kernel_states)
    for _ in range(3):
        u = torch.randn(3, 1, 64, device="cuda")
        with torch.no_grad():
            out_kernel = block.step(u, *kernel_states)[0]
        out_torch = block.step(u, *torch_states)[0].detach()    # parameters require grad: the PyTorch step
        torch.testing.assert_close(out_kernel, out_torch, atol=1e-4, rtol=1e-4)
        for got, want in zip(kernel_states, torch_states):
            torch.testing.assert_close(got, want.detach(), atol=1e-4, rtol=1e-4)
