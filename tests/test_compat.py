"""mambalab.compat: routing a mamba-ssm or transformers program onto mambalab's kernels, and the fused Mamba-2 entry
point it routes (``mamba_split_conv1d_scan_combined``).

The proof runs the models as users build them (mamba-ssm's Mamba2, Mamba and MambaLMHeadModel with their default
config, transformers' Mamba2ForCausalLM in training mode) through mambalab.determinism.library_step: routed, the
gradients repeat bit for bit over runs and under every emulated GPU profile, and equal the libraries' own within
rounding. On the CPU only transformers' own path runs (PyTorch); mamba-ssm's models need its CUDA and Triton
kernels, so tests/test_compat_gpu.py compares with them on a GPU.
"""
from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
import torch.nn.functional as F

from mambalab import compat, oracle
from mambalab.determinism import ARCH_PROFILES, library_step
from mambalab.ops import mamba_split_conv1d_scan_combined

from conftest import benchmark_module


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


# ------------------------------------------------------------------------------------------------- routing
def test_routing_binds_every_module_that_holds_a_name_and_undo_restores_them():
    ssd = oracle.module("ops.triton.ssd_combined")
    block = oracle.module("modules.block")
    mamba2 = oracle.module("modules.mamba2")
    before = (ssd.mamba_split_conv1d_scan_combined, block.layer_norm_fn, mamba2.causal_conv1d_fn)
    routing = compat.use_mambalab_kernels(transformers=False)
    try:
        assert ssd.mamba_split_conv1d_scan_combined is mamba_split_conv1d_scan_combined
        assert mamba2.mamba_split_conv1d_scan_combined is mamba_split_conv1d_scan_combined
        assert block.layer_norm_fn.__module__ == "mambalab.ops.layer_norm"
        assert mamba2.causal_conv1d_fn.__module__ == "mambalab.ops.conv1d"
        where = {(b.module, b.name) for b in routing.bound}
        assert ("mamba_ssm.models.mixer_seq_simple", "layer_norm_fn") in where
        assert ("mamba_ssm.modules.mamba_simple", "mamba_inner_fn") in where
        assert any("mamba3" in w for w, _ in routing.left)         # said, not silently skipped
        assert "mamba_split_conv1d_scan_combined" in routing.summary()
    finally:
        routing.undo()
    assert (ssd.mamba_split_conv1d_scan_combined, block.layer_norm_fn, mamba2.causal_conv1d_fn) == before


def test_undo_restores_a_module_first_imported_by_the_routing(monkeypatch):
    """mamba2_simple imports ssd_combined's functions by name and nothing imports it before the routing does: were
    it imported after ssd_combined's names were bound, it would record mambalab's functions as its originals."""
    import sys

    oracle.load()
    simple = "mamba_ssm.modules.mamba2_simple"
    monkeypatch.delitem(sys.modules, simple, raising=False)
    routing = compat.use_mambalab_kernels(transformers=False)
    routing.undo()
    assert any(b.module == simple for b in routing.bound)
    held = {f"{b.module}.{b.name}": getattr(importlib.import_module(b.module), b.name) for b in routing.bound}
    still_ours = [name for name, fn in held.items() if getattr(fn, "__module__", "").startswith("mambalab")]
    assert still_ours == []
    assert [b.describe() for b in routing.bound if "(was mambalab" in b.describe()] == []


def test_routing_as_a_context_manager_restores_the_determinism_settings():
    from mambalab.determinism.switch import Settings, set_deterministic

    set_deterministic(False)
    try:
        before = Settings.capture().as_dict()
        with compat.use_mambalab_kernels(transformers=False):
            assert torch.are_deterministic_algorithms_enabled()
        assert Settings.capture().as_dict() == before
    finally:
        set_deterministic(False)
        torch.use_deterministic_algorithms(False)


def test_routing_changes_nothing_for_a_library_that_is_absent(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("mamba_ssm", "transformers") else real(name, *a))
    routing = compat.use_mambalab_kernels(deterministic=False)
    assert routing.bound == []
    assert ("mamba_ssm", "not installed") in routing.left and ("transformers", "not installed") in routing.left


def test_routing_refuses_another_mamba_ssm_version(monkeypatch):
    monkeypatch.setattr(oracle, "version", lambda: "2.2.4")
    with pytest.raises(RuntimeError, match="2.2.4"):
        compat.use_mambalab_kernels()


def test_routing_binds_transformers_mamba2_kernel_wrappers():
    tf = importlib.import_module("transformers.models.mamba2.modeling_mamba2")
    before = tf.mamba2_split_conv1d_scan_combined
    with compat.use_mambalab_kernels(mamba_ssm=False, deterministic=False) as routing:
        assert tf.mamba2_split_conv1d_scan_combined.__wrapped__ is mamba_split_conv1d_scan_combined
        with pytest.raises(TypeError, match="cu_seqlens"):   # an argument it cannot honour is named
            tf.mamba2_split_conv1d_scan_combined(None, None, None, None, None, None, 16, cu_seqlens=torch.zeros(2))
    assert tf.mamba2_split_conv1d_scan_combined is before
    assert routing.active is False


# ------------------------------------------------------------------------------ the fused Mamba-2 entry point
def _fused_inputs(b=2, l=48, h=4, p=8, g=2, n=8, d_mlp=0, width=4, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    d = h * p
    r = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(dtype).requires_grad_()
    return dict(
        zxbcdt=r(b, l, 2 * d_mlp + 2 * d + 2 * g * n + h),
        conv1d_weight=r(d + 2 * g * n, width, scale=0.5), conv1d_bias=r(d + 2 * g * n, scale=0.1),
        dt_bias=(torch.rand(h, generator=gen) - 2).requires_grad_(),
        A=(-torch.rand(h, generator=gen) - 0.5).requires_grad_(), D=r(h),
        rmsnorm_weight=r(d, scale=0.2),
        outproj_weight=r(16, d_mlp + d, scale=0.2), outproj_bias=r(16, scale=0.1),
    ), dict(headdim=p, ngroups=g)


def _fused_reference(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size, rmsnorm_weight, outproj_weight,
                     outproj_bias, headdim, ngroups, norm_before_gate, d_mlp):
    """The same function from mamba-ssm's PyTorch references (its SSD chunk references and gated-norm reference)
    and F.conv1d, in float64: independent of mambalab's ops."""
    f = lambda t: None if t is None else t.double()
    ssd = oracle.module("ops.triton.ssd_combined")
    gated = oracle.module("ops.triton.layernorm_gated")
    h, p, g = A.shape[0], headdim, ngroups
    d = h * p
    n = (conv1d_weight.shape[0] - d) // (2 * g)
    zx0, z, xBC, dt = f(zxbcdt).split([2 * d_mlp, d, d + 2 * g * n, h], dim=-1)
    width = conv1d_weight.shape[1]
    xBC = F.silu(F.conv1d(xBC.transpose(1, 2), f(conv1d_weight)[:, None], f(conv1d_bias), padding=width - 1,
                          groups=xBC.shape[-1])[..., :xBC.shape[1]]).transpose(1, 2)
    x, B, C = xBC.split([d, g * n, g * n], dim=-1)
    y = ssd.ssd_chunk_scan_combined_ref(x.unflatten(-1, (h, p)), dt, f(A), B.unflatten(-1, (g, n)),
                                        C.unflatten(-1, (g, n)), chunk_size, D=f(D), dt_bias=f(dt_bias),
                                        dt_softplus=True)
    y = gated.rms_norm_ref(y.flatten(-2), f(rmsnorm_weight), None, z=z, eps=1e-6, group_size=d // g,
                           norm_before_gate=norm_before_gate)
    if d_mlp:
        z0, x0 = zx0.chunk(2, dim=-1)
        y = torch.cat([F.silu(z0) * x0, y], dim=-1)
    return F.linear(y, f(outproj_weight), f(outproj_bias))


@pytest.mark.parametrize("d_mlp, norm_before_gate", [(0, False), (8, True)])
def test_fused_entry_point_matches_mamba_ssm_references_with_gradients(d_mlp, norm_before_gate):
    args, kw = _fused_inputs(d_mlp=d_mlp)
    out = mamba_split_conv1d_scan_combined(**{k: v for k, v in args.items()}, chunk_size=16,
                                           norm_before_gate=norm_before_gate, **kw)
    ref = _fused_reference(**args, chunk_size=16, norm_before_gate=norm_before_gate, d_mlp=d_mlp, **kw)
    assert out.shape == ref.shape == (2, 48, 16)
    assert _rel(out, ref) < 1e-5
    grad = torch.randn_like(out)
    mine = torch.autograd.grad(out, list(args.values()), grad)
    theirs = torch.autograd.grad(ref, list(args.values()), grad.double())
    for name, a, b in zip(args, mine, theirs):
        assert _rel(a, b) < 1e-4, name


def test_fused_entry_point_without_norm_gates_inside_the_scan_and_returns_final_states():
    args, kw = _fused_inputs()
    args.pop("rmsnorm_weight")
    out, final = mamba_split_conv1d_scan_combined(**args, chunk_size=16, return_final_states=True, **kw)
    from mambalab.modules import Mamba2   # noqa: F401  (the block composes the same pieces)
    ssd = oracle.module("ops.triton.ssd_combined")
    f = lambda t: t.detach().double()
    h, p, g, d = 4, 8, 2, 32
    n = 8
    zx, z, xBC, dt = f(args["zxbcdt"]).split([0, d, d + 2 * g * n, h], dim=-1)
    xBC = F.silu(F.conv1d(xBC.transpose(1, 2), f(args["conv1d_weight"])[:, None], f(args["conv1d_bias"]),
                          padding=3, groups=xBC.shape[-1])[..., :48]).transpose(1, 2)
    x, B, C = xBC.split([d, g * n, g * n], dim=-1)
    y = ssd.ssd_chunk_scan_combined_ref(x.unflatten(-1, (h, p)), dt, f(args["A"]), B.unflatten(-1, (g, n)),
                                        C.unflatten(-1, (g, n)), 16, D=f(args["D"]), z=z.unflatten(-1, (h, p)),
                                        dt_bias=f(args["dt_bias"]), dt_softplus=True)
    ref = F.linear(y.flatten(-2), f(args["outproj_weight"]), f(args["outproj_bias"]))
    assert _rel(out, ref) < 1e-5
    assert final.shape == (2, h, p, n) and final.dtype == torch.float32


@pytest.mark.parametrize("change, message", [
    (dict(activation="relu"), "activation"),
    (dict(D=torch.ones(4), headdim=None), "headdim"),
    (dict(ngroups=3), "ngroups"),
    (dict(A=torch.ones(5)), "A"),
    (dict(outproj_weight=None), "outproj_bias"),
    (dict(rmsnorm_weight=torch.ones(31)), "rmsnorm_weight"),
])
def test_fused_entry_point_names_a_bad_argument(change, message):
    args, kw = _fused_inputs()
    with pytest.raises(ValueError, match=message):
        mamba_split_conv1d_scan_combined(**{**args, "chunk_size": 16, **kw, **change})


def test_fused_entry_point_rows_do_not_depend_on_the_batch():
    """Batch invariance: row 0's output and input gradient are the same bits alone as beside another row."""
    args, kw = _fused_inputs(b=2)
    outs, grads = [], []
    for b in (2, 1):
        z = args["zxbcdt"].detach()[:b].clone().requires_grad_()
        rest = {k: v for k, v in args.items() if k != "zxbcdt"}
        out = mamba_split_conv1d_scan_combined(z, **rest, chunk_size=16, **kw)
        out.backward(torch.ones_like(out))
        outs.append(out[0].detach())
        grads.append(z.grad[0])
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])


# --------------------------------------------------------------------------- the models users run, routed
@pytest.mark.parametrize("model", library_step.MODELS)
def test_routed_library_models_repeat_bit_for_bit_and_do_not_read_the_sm_count(model):
    """Two runs, emulating an RTX 4090 (128 SMs) and an RTX A6000 (84 SMs): one fingerprint means the step
    repeats and no launcher sized its work by the SM count."""
    runs = [library_step.run(model, emulate_profile=p) for p in ("rtx4090", "rtxa6000")]
    assert runs[0]["fingerprint"] == runs[1]["fingerprint"], "a rerun differs, or a launcher read the (emulated) GPU"
    assert len(runs[0]["parameters"]) >= 5 and runs[0]["routed"] is True


def test_routed_step_reads_no_memory_it_did_not_write(monkeypatch):
    """The switch turns off torch's NaN fill of new empty tensors (its cost on a GPU is a fill kernel a tensor).
    With the fill on, an element no kernel wrote is NaN, and a step that read one would give other bits than
    with the fill off: the same fingerprint both ways means every element read was written."""
    from mambalab.determinism import switch

    without_fill = library_step.run("mamba_ssm.MambaLMHeadModel")
    target = switch._target
    monkeypatch.setattr(switch, "_target", lambda flag, now: dataclasses.replace(target(flag, now),
                                                                                 fill_uninitialized_memory=flag))
    with_fill = library_step.run("mamba_ssm.MambaLMHeadModel")
    assert not without_fill["settings"]["fill_uninitialized_memory"]
    assert with_fill["settings"]["fill_uninitialized_memory"] and with_fill["settings"]["torch_deterministic"]
    assert with_fill["fingerprint"] == without_fill["fingerprint"]
    assert with_fill["output"] == without_fill["output"]


@pytest.mark.parametrize("model", [m for m in library_step.MODELS if m.startswith("transformers.")])
def test_routed_transformers_model_matches_its_own_path_within_rounding(model):
    """Routed against transformers' own computation: on a CPU its PyTorch path (mamba-ssm's models need its
    CUDA or Triton kernels for their own path: tests/test_compat_gpu.py compares those on a GPU). With the cache
    the mixers call the conv and the chunked scan, without it the fused function: both are routed."""
    _, mine = library_step.run(model, return_tensors=True)
    _, theirs = library_step.run(model, routed=False, return_tensors=True)
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert _rel(mine[name], theirs[name]) < 2e-4, name


def test_library_step_names_a_bad_argument():
    with pytest.raises(ValueError, match="model"):
        library_step.run("mamba_ssm.Mamba4")
    with pytest.raises(ValueError, match="batch"):
        library_step.run("mamba_ssm.Mamba2", batch=3)
    with pytest.raises(ValueError, match="size"):
        library_step.run("mamba_ssm.Mamba2", size="tpu")
    assert set(ARCH_PROFILES) >= {"rtx4090", "rtxa6000"}


def test_bench_compat_reads_which_function_transformers_resolved():
    """bench_compat.py records, beside transformers' own fingerprints, the function its fused wrapper resolved at
    import: mamba-ssm's, or its PyTorch path where mamba-ssm did not import then. "unknown" would mean that the
    wrapper's layout (transformers 5.25's integrations/hub_kernels.py) is not the one read."""
    oracle.load()
    assert benchmark_module("bench_compat")._transformers_fused_function() in ("mamba_ssm.ops.triton.ssd_combined", "PyTorch")


def test_bench_compat_routed_only_fingerprints_run_no_mamba_ssm_kernel(tmp_path, monkeypatch):
    """``bench_compat.py fingerprints --routed-only``, the comparison of GPUs at its least cost: each model's routed
    step is run and saved and its row written, and not one step of the library's own kernels is run. The steps
    are stand-ins here (the script's plumbing is what is tested; the steps are tested above and on a GPU)."""
    bench = benchmark_module("bench_compat")
    from mambalab.determinism import step

    calls = []

    def fake_run(model, routed=True, size="cpu", emulate_profile=None, return_tensors=False, **_):
        calls.append((model, routed, emulate_profile))
        report = dict(fingerprint=f"{model}:{emulate_profile}" if emulate_profile == "rtx4090" else model)
        return (report, {"grad/w": torch.ones(2)}) if return_tensors else report

    monkeypatch.setattr(library_step, "run", fake_run)
    monkeypatch.setattr(step, "run_step", lambda return_tensors: (dict(fingerprint="own-step"), {}))
    monkeypatch.setattr(step, "save_step", lambda path, report, tensors: path.write_text(report["fingerprint"]))
    monkeypatch.setattr(bench, "_gpu_tag", lambda: "gpu")
    monkeypatch.setattr(bench, "_transformers_fused_function", lambda: "PyTorch")
    result = bench.fingerprints(tmp_path, routed_only=True)

    assert calls and all(routed for _, routed, _ in calls)
    rows = result["rows"][1:]
    assert [r["model"] for r in rows] == list(library_step.MODELS)
    assert all("error" not in r and r["routed_patterns_over_runs"] == 1 for r in rows)
    assert all(r["routed_patterns_over_profiles"] == 2 for r in rows)   # the stand-in differs under one profile
    assert (tmp_path / "compat_fingerprints_routed.json").exists()
    assert sorted(p.name for p in tmp_path.glob("*.pt")) == sorted(
        ["gpu_mambalab.pt"] + [f"gpu_{bench._file_name(m)}.pt" for m in library_step.MODELS])
