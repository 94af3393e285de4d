"""Every kernel launch of every op compiles for sm_90, checked on a machine without a GPU.

The CPU tests run the kernels through Triton's interpreter, which never compiles them: a kernel the GPU's
compiler rejects (an annotated global ``LOG2E: tl.constexpr = 1.44`` is a NameError there) passes them all.
Here each op runs forward and backward at small shapes (and at the benchmarks' tiles) with its launches
recorded instead of run (:func:`mambalab.aot.record_launches`, as a GPU launch would specialise them, bf16
kept bf16), and every distinct launch is compiled for sm_90 by Triton's compiler in a child process with
the interpreter off (:func:`mambalab.aot.compile_in_subprocess`, one child a core, each with an empty Triton
cache so that nothing is reused); a failure names the launch and shows Triton's error. Each launch must also
fit in sm_90's shared memory.
A last test checks that the recorded launches cover every kernel in the package, so that a new kernel
cannot slip past. On a GPU this file is skipped: the other tests compile every kernel there for real."""
import ast
import contextlib
import dataclasses
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import mambalab
from mambalab import aot, device
from mambalab.determinism.atomics import atomic_sum
from mambalab.ops import mamba3_chunk_scan, mamba3_step, selective_scan, ssd_chunk_scan, ssd_chunk_scan_forward
from mambalab.kernels.norm import gated_norm_fwd
from mambalab.ops.conv1d import causal_conv1d_fn
from mambalab.ops.conv_update import causal_conv1d_update
from mambalab.ops.state_update import selective_state_update
from mambalab.ref.mamba3 import zero_state

from conftest import benchmark_module, make_mamba3_inputs, make_ssd_inputs

pytestmark = pytest.mark.skipif(not device.interpreter_active(),
                                reason="records launches through Triton's interpreter (a machine without a GPU); "
                                       "on a GPU the other tests compile every kernel for real")
ARCH = 90
SHARED_MEMORY = 232448   # bytes a program may use on sm_90 (227 KiB); Triton refuses to launch a kernel needing more


def _backward(out):
    """Backward from ``out`` (a tensor, or a tuple of them) with ones, through every float leaf."""
    outs = [t for t in (out if isinstance(out, tuple) else (out,)) if t.requires_grad]
    torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])


def _leaves(inputs: dict) -> dict:
    return {k: (t.requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
            for k, t in inputs.items()}


def _selective_scan(dtype, g=None, extras=True, l=200):
    # l=200: the backward walks two blocks of 128 steps (a count of one would become a constexpr)
    b, d, n = 2, 8, 16
    gen = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=gen).to(dtype).requires_grad_()
    bc = (b, n, l) if g is None else (b, g, n, l)
    opt = dict(D=r(d).float(), z=r(b, d, l), delta_bias=r(d).float(), delta_softplus=True) if extras else {}
    _backward(selective_scan(r(b, d, l), r(b, d, l), -torch.rand(d, n).requires_grad_(), r(*bc), r(*bc), **opt,
                             return_last_state=True))


def _ssd(dtype, reduction="deterministic", h=4, p=16, g=2, n=16, chunk=16):
    x = _leaves(make_ssd_inputs(2, 2 * chunk, h, p, g, n, D="hp", dtype=dtype, param_dtype=torch.float32))
    _backward(ssd_chunk_scan(**x, chunk_size=chunk, dt_softplus=True, return_final_states=True, reduction=reduction))


def _precomputed_cb(case):
    """``case`` with the SSD tile rule's precompute_cb set (the chunk scan reads chunk_cb's C Bᵀ), which the rule
    sets only for fp32 with 8 or more heads a group: the kernels that path launches compile at these small
    shapes, and in bf16, too."""
    from mambalab.kernels.ssd import forward, tiles

    def run():
        rule = forward.tile_config
        forward.tile_config = lambda *a, **k: dataclasses.replace(tiles.tile_config(*a, **k), precompute_cb=True)
        try:
            case()
        finally:
            forward.tile_config = rule
    return run


def _ssd_packed(dtype, reduction="deterministic", h=4, p=16, g=2, n=16, chunk=16):
    """Three packed sequences in one row (boundaries inside chunks), with each sequence's final state."""
    l = 3 * chunk
    lengths = [chunk // 2 + 1, chunk + 3, l - (chunk // 2 + 1) - (chunk + 3)]
    x = _leaves(make_ssd_inputs(1, l, h, p, g, n, D="hp", init=False, dtype=dtype, param_dtype=torch.float32))
    seq_idx = torch.repeat_interleave(torch.arange(3, dtype=torch.int32), torch.tensor(lengths))[None]
    cu_seqlens = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    out = ssd_chunk_scan(**x, chunk_size=chunk, seq_idx=seq_idx, cu_seqlens=cu_seqlens, dt_softplus=True,
                         return_final_states=True, return_varlen_states=True, reduction=reduction)
    _backward(out[:2])


def _scan_minimal(kind, block_d, block_l=32):
    """bf16 inputs at chapter 01's GPU tiles (its MIN_BLOCK_D_LOOP, MIN_BLOCK_D_ASSOC, MIN_BLOCK_L = 32, 4, 32):
    the launches its minimal kernels make on a GPU."""
    from mambalab.kernels.selective_scan_minimal import selective_scan_minimal
    b, d, n, l = 2, 64, 16, 96
    u, delta = torch.randn(b, d, l, dtype=torch.bfloat16), torch.rand(b, d, l, dtype=torch.bfloat16)
    B, C = torch.randn(b, n, l, dtype=torch.bfloat16), torch.randn(b, n, l, dtype=torch.bfloat16)
    selective_scan_minimal(u, delta, -torch.rand(d, n), B, C, kind=kind, block_d=block_d, block_l=block_l)


def _ssd_forward(dtype):
    x = make_ssd_inputs(2, 64, 4, 16, 1, 16, D="h", z=False, dtype=dtype, param_dtype=torch.float32)
    ssd_chunk_scan_forward(**x, chunk_size=16)


def _mamba3(r, dtype=torch.bfloat16, p=16, n=16, a=4, chunk=None):
    chunk = chunk or (16 if r == 1 else 8)    # chunk · r >= 16
    x = _leaves(make_mamba3_inputs(2, 2 * chunk, 4, p, 2, n, r, a, init=True, dtype=dtype))
    _backward(mamba3_chunk_scan(**x, chunk_size=chunk, return_final_state=True)[0])


def _mamba3_packed(r, dtype=torch.bfloat16, p=16, n=16, a=4, chunk=None, reduction=None):
    chunk = chunk or (16 if r == 1 else 8)
    x = make_mamba3_inputs(1, 3 * chunk, 4, p, 2, n, r, a, dtype=dtype)
    cu = torch.tensor([0, 1, chunk + 3, 2 * chunk, 3 * chunk], dtype=torch.int32)
    _backward(mamba3_chunk_scan(**_leaves(x), chunk_size=chunk, reduction=reduction, cu_seqlens=cu))
    with torch.no_grad():   # the per-sequence final states
        mamba3_chunk_scan(**x, chunk_size=chunk, return_final_state=True, cu_seqlens=cu)


def _mamba3_step(r, dtype=torch.bfloat16, p=16, n=16, a=4):
    x = make_mamba3_inputs(2, 1, 4, p, 2, n, r, a, dtype=dtype)
    token = {k: (t[:, 0] if k in ("q", "k", "v", "adt", "dt", "trap", "angles", "z") else t) for k, t in x.items()}
    with torch.no_grad():
        mamba3_step(zero_state(2, 4, p, n, r, a, torch.float32, "cpu"), **token)


def _state_update(dtype, b=2, h=4, p=8, n=16, heads=True, index=False):
    gen = torch.Generator().manual_seed(0)
    r = lambda *shape: torch.randn(*shape, generator=gen).to(dtype)
    if heads:   # Mamba-2: Δ, A, D, dt_bias per head, broadcast; gated; dt_limit
        args = (r(b, h, p, n), r(b, h, p), r(b, h)[..., None].expand(b, h, p),
                -torch.rand(h)[:, None, None].expand(h, p, n), r(b, 2, n), r(b, 2, n), torch.randn(h, p))
        kw = dict(z=r(b, h, p), dt_bias=torch.randn(h)[:, None].expand(h, p), dt_limit=(0.0, 1.0))
    else:       # Mamba-1: per channel, no heads
        args = (r(b, p, n), r(b, p), r(b, p), -torch.rand(p, n), r(b, n), r(b, n), torch.randn(p))
        kw = dict(z=r(b, p), dt_bias=torch.randn(p))
    if index:
        kw["state_batch_indices"] = torch.arange(b, dtype=torch.int32)
    with torch.no_grad():
        selective_state_update(*args, **kw, dt_softplus=True)


def _conv_update(dtype, b=2, channels=300, width=4):
    x, state, weight, bias = (torch.randn(*s).to(dtype) for s in ((b, channels), (b, channels, width),
                                                                   (channels, width), (channels,)))
    with torch.no_grad():
        causal_conv1d_update(x, state, weight, bias, activation="silu")


def _causal_conv1d(dtype, channel_last=True, packed=False, b=2, d=80, l=100, width=4):
    """Forward and backward; channel-last x (mamba-ssm's layout) with the states, or contiguous x with seq_idx."""
    x = torch.randn(b, d, l).to(dtype)
    x = (x.transpose(1, 2).contiguous().transpose(1, 2) if channel_last else x).requires_grad_()
    weight, bias = torch.randn(d, width).requires_grad_(), torch.randn(d).requires_grad_()
    if packed:
        seq_idx = torch.tensor([0] * 30 + [1] * (l - 40) + [-1] * 10, dtype=torch.int32).expand(b, l).contiguous()
        _backward(causal_conv1d_fn(x, weight, seq_idx=seq_idx))
    else:
        init = torch.randn(b, d, width - 1).to(dtype).requires_grad_()
        _backward(causal_conv1d_fn(x, weight, bias, initial_states=init, return_final_states=True, activation="silu"))


def _gated_norm(dtype, d=96, group_size=48, gated=True):
    x, z = (torch.randn(3, d).to(dtype) for _ in range(2))
    gated_norm_fwd(x, torch.ones(d, dtype=dtype), torch.zeros(d, dtype=dtype) if not gated else None,
                   z if gated else None, 1e-5, group_size, False, gated)


def _norm_train(dtype, d=96, group_size=48, norm_before_gate=True):
    """The gated RMS norm's training kernels (forward with statistics, backward, the dw fold), 70 rows: through
    layernorm_kernels, layernorm_fn's path on a GPU (on the CPU layernorm_fn runs the PyTorch form)."""
    from mambalab.modules.norm import layernorm_kernels
    x, z, w = (torch.randn(*s).to(dtype).requires_grad_() for s in ((70, d), (70, d), (d,)))
    _backward(layernorm_kernels(x, w, None, z, 1e-5, group_size, norm_before_gate, True))


def _layer_norm(dtype, n=96):
    """layer_norm_fn's options on: LayerNorm, bias, an fp32 residual stream, prenorm (ds, dresidual, db)."""
    from mambalab.ops import layer_norm_fn
    x, w, b = (torch.randn(*s).to(dtype).requires_grad_() for s in ((70, n), (n,), (n,)))
    _backward(layer_norm_fn(x, w, b, residual=torch.randn(70, n).requires_grad_(), prenorm=True))


def _atomic_sum():
    # nothing ran, so the programs' landing order cannot be chained from the (unwritten) results
    with contextlib.suppress(RuntimeError):
        atomic_sum(torch.randn(64), block=16)


# Small shapes (small tiles, quick to compile), each op's options on; then the benchmarks' tiles ("gpu-tiles":
# the selective scan's 512-step blocks; SSD at p=64, n=128, q=256; Mamba-3 MIMO at p=64, n=128, q=16, r=4),
# where sm_90's compiler takes other paths (wgmma for the larger dots) and shared memory is largest.
CASES = {
    "selective_scan-fp32": lambda: _selective_scan(torch.float32),
    "selective_scan-bf16": lambda: _selective_scan(torch.bfloat16),
    "selective_scan-bf16-grouped": lambda: _selective_scan(torch.bfloat16, g=2),
    "selective_scan-fp32-plain": lambda: _selective_scan(torch.float32, extras=False),
    "selective_scan-bf16-gpu-tiles": lambda: _selective_scan(torch.bfloat16, l=1024),
    "ssd_chunk_scan-bf16": lambda: _ssd(torch.bfloat16),
    "ssd_chunk_scan-fp32": lambda: _ssd(torch.float32),
    "ssd_chunk_scan-bf16-atomic": lambda: _ssd(torch.bfloat16, "atomic"),
    "ssd_chunk_scan-bf16-gpu-tiles": lambda: _ssd(torch.bfloat16, h=2, p=64, g=1, n=128, chunk=256),
    "ssd_chunk_scan_forward-bf16": lambda: _ssd_forward(torch.bfloat16),
    "ssd_chunk_scan-bf16-packed": lambda: _ssd_packed(torch.bfloat16),
    "ssd_chunk_scan-fp32-packed-atomic": lambda: _ssd_packed(torch.float32, "atomic"),
    "ssd_chunk_scan-bf16-packed-gpu-tiles": lambda: _ssd_packed(torch.bfloat16, h=2, p=64, g=1, n=128, chunk=256),
    "ssd_chunk_scan-fp32-precomputed-cb": _precomputed_cb(lambda: _ssd_packed(torch.float32)),
    "ssd_chunk_scan-bf16-precomputed-cb-gpu-tiles": _precomputed_cb(
        lambda: _ssd(torch.bfloat16, h=2, p=64, g=1, n=128, chunk=256)),
    "selective_scan_minimal-loop": lambda: _scan_minimal("loop", 32),
    "selective_scan_minimal-assoc": lambda: _scan_minimal("assoc", 4),
    "mamba3_chunk_scan-r1": lambda: _mamba3(1),
    "mamba3_chunk_scan-r4": lambda: _mamba3(4),
    "mamba3_chunk_scan-r4-fp32": lambda: _mamba3(4, torch.float32),
    "mamba3_chunk_scan-r4-gpu-tiles": lambda: _mamba3(4, p=64, n=128, a=32, chunk=16),
    "mamba3_chunk_scan-r1-packed": lambda: _mamba3_packed(1),
    "mamba3_chunk_scan-r4-packed-atomic": lambda: _mamba3_packed(4, reduction="atomic"),
    "mamba3_chunk_scan-r4-packed-gpu-tiles": lambda: _mamba3_packed(4, p=64, n=128, a=32, chunk=16),
    "mamba3_step-r1": lambda: _mamba3_step(1),
    "mamba3_step-r2": lambda: _mamba3_step(2),   # step_config's FLAT loop
    "mamba3_step-r4": lambda: _mamba3_step(4),
    "mamba3_step-r4-gpu-tiles": lambda: _mamba3_step(4, p=64, n=128, a=32),
    "state_update-bf16-mamba2": lambda: _state_update(torch.bfloat16),
    "state_update-fp32-mamba1-indexed": lambda: _state_update(torch.float32, heads=False, index=True),
    "state_update-bf16-gpu-tiles": lambda: _state_update(torch.bfloat16, b=64, h=80, p=64, n=128),
    "conv_update-bf16": lambda: _conv_update(torch.bfloat16),
    "causal_conv1d_fn-bf16-channel-last": lambda: _causal_conv1d(torch.bfloat16),
    "causal_conv1d_fn-fp32-packed": lambda: _causal_conv1d(torch.float32, channel_last=False, packed=True),
    "gated_norm-bf16-rms-gated": lambda: _gated_norm(torch.bfloat16),
    "gated_norm-bf16-layernorm": lambda: _gated_norm(torch.bfloat16, gated=False),
    "gated_norm-bf16-gpu-tiles": lambda: _gated_norm(torch.bfloat16, d=5120, group_size=5120),
    "norm_train-bf16-rms-gated-groups": lambda: _norm_train(torch.bfloat16),
    "norm_train-bf16-gpu-tiles": lambda: _norm_train(torch.bfloat16, d=4096, group_size=4096, norm_before_gate=False),
    "layer_norm_fn-bf16-residual-fp32-prenorm": lambda: _layer_norm(torch.bfloat16),
    "atomic_sum": _atomic_sum,
}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """Each case's launches, and the outcome of compiling each distinct launch (keyed by Launch.key()).

    The distinct launches are dealt out to one child process per core left to this pytest worker, each with its
    own empty Triton cache: Triton compiles on one thread, so one child would leave the other cores idle, and
    more children than cores would only take turns."""
    launches = {case: aot.record_launches(run) for case, run in CASES.items()}
    distinct = list({launch.key(): launch for case in launches.values() for launch in case}.values())
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))   # pytest-xdist workers share the cores
    children = max(1, min(len(os.sched_getaffinity(0)) // workers, len(distinct)))
    caches = [tmp_path_factory.mktemp("triton_cache") for _ in range(children)]
    with ThreadPoolExecutor(children) as pool:   # each thread waits on its child process
        shares = pool.map(lambda k: aot.compile_in_subprocess(distinct[k::children], ARCH, cache_dir=caches[k]),
                          range(children))
        results = [c for share in shares for c in share]
    assert len(results) == len(distinct)
    return launches, {c.launch.key(): c for c in results}


def _describe(launch: aot.Launch) -> str:
    settings = {**launch.options, **{k: v for k, v in launch.constexprs.items() if k.isupper()}}
    return f"{launch.kernel} ({', '.join(f'{k}={v}' for k, v in settings.items())})"


@pytest.mark.parametrize("case", CASES)
def test_every_launch_compiles_for_sm90(compiled, case):
    launches, results = compiled
    assert launches[case], f"{case} launched no kernel"
    outcomes = [results[launch.key()] for launch in launches[case]]
    failed = [c for c in outcomes if c.error]
    if failed:   # Triton's message says where and why; pytest's own rendering of the list would bury it
        pytest.fail(f"{len(failed)} of {len(outcomes)} launches of {case} do not compile for sm_{ARCH}:\n\n"
                    + "\n\n".join(f"{_describe(c.launch)}:\n{c.error}" for c in failed), pytrace=False)
    too_big = [f"{_describe(c.launch)}: {c.shared} bytes" for c in outcomes if c.shared > SHARED_MEMORY]
    assert not too_big, f"launches of {case} that need more shared memory than sm_{ARCH} has ({SHARED_MEMORY} " \
        "bytes), so they would fail to launch:\n" + "\n".join(too_big)


def _kernels_in_package() -> set[str]:
    """Every ``@triton.jit`` function of mambalab that is a kernel: launched somewhere in the package
    (``name[grid](...)``), or named ``*_kernel``; as "module.name". Read from the source, importing nothing."""
    root = Path(mambalab.__file__).parent
    jitted, launched = {}, set()
    for path in sorted(root.rglob("*.py")):
        module = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef) and any(
                    ast.unparse(d).split("(")[0] in ("triton.jit", "jit") for d in node.decorator_list):
                jitted.setdefault(node.name, set()).add(f"{module}.{node.name}")
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript):
                target = node.func.value    # kernel[grid](...) or module.kernel[grid](...)
                launched.add(getattr(target, "id", None) or getattr(target, "attr", None))
    return {full for name, fulls in jitted.items() if name in launched or name.endswith("_kernel") for full in fulls}


def test_recorded_launches_cover_every_kernel(compiled):
    launches, _ = compiled
    recorded = {launch.kernel for case in launches.values() for launch in case}
    kernels = _kernels_in_package()
    assert "mambalab.kernels.reduce.sum_partials_kernel" in kernels, f"the search found only {sorted(kernels)}"
    missing = kernels - recorded
    assert not missing, (f"kernels that no case of {__name__} launches, so nothing checks that they compile for "
                         f"a GPU: {sorted(missing)}; add a case to CASES that launches them")


# Loops that are faster software-pipelined on an H200 (2026-11-30_h200_mamba3_loop_stages_ab.json), at the rank
# where they are: compiled for sm_90 without `tl.range(..., num_stages=...)` a loop has no async copies.
PIPELINED = {"mamba3_chunk_scan-r1": ("angle_cumsum_fwd_kernel", "angle_cumsum_bwd_kernel", "rotary_qk_bwd_kernel")}


@pytest.mark.parametrize("case", PIPELINED)
def test_pipelined_loops_keep_their_async_copies(compiled, case):
    launches, results = compiled
    outcomes = {c.launch.name: c for c in (results[launch.key()] for launch in launches[case])}
    for name in PIPELINED[case]:
        c = outcomes[name]
        assert c.loops >= 1 and c.async_copies > 0, (
            f"{name} in {case}: {c.loops} loops, {c.async_copies} asynchronous copies: its loop's loads are "
            "no longer software-pipelined")


def test_sass_counter_reads_opcodes_with_predicates_and_modifiers():
    """benchmarks/sass_mamba3_step.py counts a cuobjdump listing's instructions by opcode: a predicate (@P0, @!P5)
    and modifiers (.FTZ) do not hide one, and the hex words and labels are not counted."""
    sass = benchmark_module("sass_mamba3_step")
    listing = """
        /*0090*/                   FFMA R3, R2, R5, R3 ;                    /* 0x0000000502037223 */
        /*00a0*/              @!P5 FMUL.FTZ R2, RZ, R14 ;                   /* 0x0000000eff02d220 */
        /*00b0*/               @P0 SHFL.BFLY PT, R4, R3, 0x1, 0x1f ;        /* 0x0c201f0003047f89 */
        /*00c0*/                   LDG.E.EF.128 R8, desc[UR4][R6.64] ;       /* 0x0000000406087981 */
.L_x_1:
        /*00d0*/                   EXIT ;                                   /* 0x000000000000794d */
"""
    ops = sass.counts(listing)
    assert ops == {"FFMA": 1, "FMUL": 1, "SHFL": 1, "LDG": 1, "EXIT": 1}
    assert sass.by_kind(ops) == {"fp32 math": 2, "shuffles": 1, "memory": 1, "control": 1}
