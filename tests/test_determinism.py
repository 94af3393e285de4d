"""mambalab.determinism's API: fingerprints (stable, layout/device-independent, sensitive to one bit), the GPU
profiles and emulate() (what mamba-ssm reads, the autotuner's pick), the program-order simulation on the
CPU interpreter, and the switch (sets every setting, restores every one, also on an exception).

The kernels' invariance under all of these is in test_determinism_kernels.py."""
import copy
import os

import pytest
import torch
import triton
import triton.language as tl

from mambalab import device
from mambalab.determinism import (ARCH_PROFILES, ArchProfile, Settings, autotune, current_profile, deterministic,
                                  emulate, fingerprint, is_deterministic, program_order_log, resolve_reduction,
                                  set_deterministic, shuffled_program_order)

from conftest import KERNEL_DEVICE, requires_gpu

requires_interpreter = pytest.mark.skipif(not device.interpreter_active(),
                                          reason="simulates program order on Triton's CPU interpreter")


# ---------------------------------------------------------------------------------------------- fingerprint
def test_fingerprint_is_16_hex_and_stable():
    t = torch.randn(3, 5, generator=torch.Generator().manual_seed(0))
    fp = fingerprint(t)
    assert len(fp) == 16 and int(fp, 16) >= 0
    assert fingerprint(t.clone()) == fp
    assert fingerprint(t) != fingerprint(t + 1)


def test_fingerprint_ignores_layout_but_not_values_shape_or_dtype():
    base = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    transposed = base.t().contiguous().t()                      # same values, column-major strides
    assert not transposed.is_contiguous()
    padded = torch.zeros(5, 8)
    padded[1:, 2:] = base
    view = padded[1:, 2:]                                       # storage offset and row stride 8
    assert fingerprint(transposed) == fingerprint(view) == fingerprint(base)
    assert fingerprint(base.reshape(6, 4)) != fingerprint(base)                 # shape
    assert fingerprint(base.double()) != fingerprint(base)                      # dtype
    assert fingerprint(torch.tensor([0.0])) != fingerprint(torch.tensor([-0.0]))  # bits, not ==
    c = torch.complex(base, base)
    assert fingerprint(c.conj()) == fingerprint(c.conj().resolve_conj())        # lazy conjugate resolved


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_one_flipped_bit_changes_the_fingerprint(dtype):
    gen = torch.Generator().manual_seed(2)
    t = torch.randn(64, generator=gen).to(dtype)
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    for _ in range(5):
        i = int(torch.randint(64, (1,), generator=gen))
        bit = int(torch.randint(8 * t.element_size() - 1, (1,), generator=gen))  # any bit but the sign's top
        flipped = t.clone()
        flipped.view(ints)[i] ^= 1 << bit
        assert not torch.equal(flipped.view(ints), t.view(ints))
        assert fingerprint(flipped) != fingerprint(t), (i, bit)


def test_fingerprint_of_containers_and_modules():
    a, b = torch.ones(2), torch.zeros(3)
    assert fingerprint([a, b]) == fingerprint((a, b)) != fingerprint([b, a])
    assert fingerprint({"a": a, "b": b}) != fingerprint({"b": b, "a": a})       # order counts
    assert fingerprint({"a": a}) != fingerprint({"c": a})                       # names count
    assert fingerprint([a, None]) != fingerprint([a])
    torch.manual_seed(0)
    m = torch.nn.Linear(3, 2)
    twin = copy.deepcopy(m)
    assert fingerprint(twin) == fingerprint(m)
    with torch.no_grad():
        twin.bias[1] = torch.nextafter(twin.bias[1], torch.tensor(1.0))        # one ulp
    assert fingerprint(twin) != fingerprint(m)
    same = copy.deepcopy(m)
    no_grads = fingerprint(m, grads=True)
    for module in (m, same):
        module(torch.ones(1, 3)).sum().backward()
    with_grads = fingerprint(m, grads=True)
    assert with_grads != no_grads and with_grads == fingerprint(same, grads=True)
    assert fingerprint(m) != with_grads


def test_fingerprint_rejects_what_it_cannot_hash():
    with pytest.raises(TypeError, match=r"obj\[1\] is a str"):
        fingerprint([torch.ones(1), "x"])
    with pytest.raises(TypeError, match="grads=True needs an nn.Module"):
        fingerprint(torch.ones(1), grads=True)
    with pytest.raises(TypeError, match="layout"):
        fingerprint(torch.eye(3).to_sparse())


@pytest.mark.gpu
@requires_gpu
def test_fingerprint_is_device_independent():
    t = torch.randn(17, 5, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert fingerprint(t.cuda()) == fingerprint(t) == fingerprint(t.cuda().t().contiguous().t())


# ---------------------------------------------------------------------------------------------- profiles, emulate
def test_profiles_are_the_issues_gpus():
    want = {"rtx4090": ((8, 9), 128), "rtxa6000": ((8, 6), 84), "rtx3090": ((8, 6), 82), "a100": ((8, 0), 108),
            "h100": ((9, 0), 132), "h200": ((9, 0), 132), "l4": ((8, 9), 58)}
    assert {k: (p.compute_capability, p.sm_count) for k, p in ARCH_PROFILES.items()} == want
    assert all(p.key == k for k, p in ARCH_PROFILES.items())
    with pytest.raises(Exception):
        ARCH_PROFILES["l4"].sm_count = 1                                        # frozen


def test_emulate_answers_what_mamba_ssm_reads():
    """mamba-ssm reads torch.cuda.get_device_properties(tensor.device).multi_processor_count (also for CPU
    tensors on this machine); emulate() answers with the profile, and torch's name helper agrees. The compute
    capability is the profile's without a GPU, and the real GPU's on one (Triton compiles for it: code for an
    emulated sm_86 does not load on an sm_90)."""
    real = torch.cuda.get_device_properties
    real_capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    for key, prof in ARCH_PROFILES.items():
        with emulate(key) as p:
            assert p is prof and current_profile() is prof
            props = torch.cuda.get_device_properties(torch.empty(0, device=KERNEL_DEVICE).device)
            assert props.multi_processor_count == prof.sm_count
            capability = real_capability or prof.compute_capability
            assert (props.major, props.minor) == capability
            assert torch.cuda.get_device_capability() == capability
            assert torch.cuda.get_device_name() == prof.name
    assert torch.cuda.get_device_properties is real and current_profile() is None


def test_emulate_reaches_mamba_ssm_launchers():
    """mamba-ssm's own Triton layer norm (on the CPU through the interpreter) sizes its backward's persistent
    grid by the SM count and sums dweight/dbias per program: under emulate() its bits follow the profile's
    rows per program, ceil(256 / SMs): 2 on an RTX 4090 and an H200, 4 on an RTX A6000."""
    from mambalab import oracle

    layer_norm_fn = oracle.module("ops.triton.layer_norm").layer_norm_fn
    select_device = torch.cuda.device       # emulate() lets it take a CPU tensor's index on a CPU-only machine
    gen = torch.Generator().manual_seed(5)
    x, dy = (torch.randn(256, 32, generator=gen).to(KERNEL_DEVICE) for _ in range(2))
    w, b = (torch.randn(32, generator=gen).to(KERNEL_DEVICE) for _ in range(2))
    seen = {}
    for key in ("rtx4090", "h200", "rtxa6000", "rtx4090"):
        with emulate(key):
            leaves = [t.clone().requires_grad_() for t in (x, w, b)]
            out = layer_norm_fn(*leaves, eps=1e-5)
            out.backward(dy)
        fps = fingerprint(out.detach()), fingerprint(leaves[0].grad), fingerprint([t.grad for t in leaves[1:]])
        assert seen.setdefault(key, fps) == fps, f"{key} did not repeat"
    torch.testing.assert_close(out.detach(), torch.nn.functional.layer_norm(x, (32,), w, b, 1e-5))
    assert len({fps[:2] for fps in seen.values()}) == 1                     # out, dx: no sum over programs
    assert seen["rtx4090"][2] == seen["h200"][2] != seen["rtxa6000"][2]      # dw, db: summed per program
    assert torch.cuda.device is select_device and current_profile() is None


def test_emulate_nests_and_restores_on_error():
    custom = ArchProfile("toy", "Toy GPU", "None", (7, 5), 3, 1)
    with pytest.raises(RuntimeError, match="inside"):
        with emulate("rtx4090"):
            with emulate(custom):
                assert torch.cuda.get_device_properties().multi_processor_count == 3
            assert current_profile().key == "rtx4090"
            raise RuntimeError("inside")
    assert current_profile() is None and autotune.policy() is None
    with pytest.raises(ValueError, match="profile must be an ArchProfile or one of"):
        with emulate("rtx5090"):
            pass


@triton.autotune(configs=[triton.Config({"BLOCK": b}) for b in (16, 32, 64, 128)], key=["n"])
@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offs, 2.0 * tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


def _picked_block(n=100):
    x = torch.arange(n, dtype=torch.float32, device=KERNEL_DEVICE)
    out = torch.empty_like(x)
    _scale_kernel[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, out, n)
    assert torch.equal(out, 2 * x)
    return _scale_kernel.best_config.kwargs["BLOCK"]


def test_autotune_pick_is_fixed_per_profile_and_pinned_by_the_switch():
    picks = {}
    for key in ARCH_PROFILES:
        with emulate(key):
            first = _picked_block()
        with emulate(key):
            assert _picked_block() == first, key                              # the same profile, the same pick
        picks[key] = first
    assert len(set(picks.values())) >= 2, picks                             # profiles differ, as GPUs do
    with deterministic():
        assert _picked_block() == 16                                        # pinned: the first configuration
        with emulate("rtxa6000"):
            assert _picked_block() == 16                                    # pinning wins over emulation
    assert autotune.policy() is None
    assert _scale_kernel.cache == {}                                         # Triton's own cache untouched


def test_autotune_stand_in_through_tritons_own_bench(monkeypatch):
    """The GPU path of the stand-in (each candidate launched through Triton's Autotuner._bench, its timing
    replaced), run here by claiming a GPU: the picks still differ between profiles. On the H200 in session 9
    they did not (every profile picked the first configuration): Triton 3.6 caches do_bench on first use."""
    monkeypatch.setattr(autotune, "_real_gpu", lambda: True)
    _scale_kernel.__dict__.pop("_mambalab_caches", None)
    picks = {}
    for key in ARCH_PROFILES:
        with emulate(key):
            picks[key] = _picked_block()
    assert len(set(picks.values())) >= 2, picks
    assert "do_bench" not in _scale_kernel.__dict__ and _scale_kernel.cache == {}   # nothing of ours left behind


# ---------------------------------------------------------------------------------------------- program order
@triton.jit
def _atomic_sum_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    tl.atomic_add(out_ptr, tl.sum(tl.load(x_ptr + pid * BLOCK + tl.arange(0, BLOCK))))


def _atomic_sum(x, programs):
    out = torch.zeros(1, dtype=torch.float32, device=x.device)
    _atomic_sum_kernel[(programs,)](x, out, BLOCK=x.numel() // programs)
    return out


@requires_interpreter
def test_shuffled_program_order_runs_every_program_once_in_a_seeded_order():
    """SIMULATION of GPU scheduling: same seed, same orders; other seeds, other orders and other atomic sums."""
    x = torch.randn(64 * 16, generator=torch.Generator().manual_seed(4)) * 1e3
    in_order = _atomic_sum(x, 64)
    assert torch.equal(_atomic_sum(x, 64), in_order)                        # the plain interpreter: grid order
    sums, orders = set(), []
    for seed in range(4):
        with shuffled_program_order(seed, record=True):
            total = _atomic_sum(x, 64)
            order = [pid for pid, _, _ in program_order_log()[0]]
        assert sorted(order) == list(range(64))                             # each program exactly once
        orders.append(order)
        sums.add(total.item())
    assert len({tuple(o) for o in orders}) == 4 and orders[0] != list(range(64))
    assert len(sums) >= 2                                                    # the atomic sum's bits move
    with shuffled_program_order(0, record=True):
        _atomic_sum(x, 64)
        assert [pid for pid, _, _ in program_order_log()[0]] == orders[0]    # replayable
    assert program_order_log() is None
    assert torch.equal(_atomic_sum(x, 64), in_order)                        # restored


@requires_interpreter
def test_shuffled_program_order_covers_three_dimensional_grids():
    from triton.runtime import interpreter

    seen = []
    builder = interpreter.interpreter_builder
    with shuffled_program_order(7, record=True):
        builder.set_grid_dim(2, 3, 4)
        for x in range(2):
            for y in range(3):
                for z in range(4):
                    builder.set_grid_idx(x, y, z)
                    seen.append(builder.grid_idx)
    assert sorted(seen) == [(x, y, z) for x in range(2) for y in range(3) for z in range(4)]
    assert seen != sorted(seen)
    assert "set_grid_idx" not in vars(builder)                               # the patch is gone


def test_shuffled_program_order_rejects_a_bad_seed():
    with pytest.raises(TypeError, match="seed must be an int"):
        with shuffled_program_order("1"):
            pass


# ---------------------------------------------------------------------------------------------- the switch
def test_resolve_reduction_follows_the_switch():
    assert is_deterministic() and resolve_reduction(None) == "deterministic"   # the library default
    with deterministic(False):
        assert resolve_reduction(None) == "atomic"
        assert resolve_reduction("deterministic") == "deterministic"        # an explicit choice wins
    assert resolve_reduction(None) == "deterministic"
    for bad in ("sum", "Atomic", 0):
        with pytest.raises(ValueError, match="reduction must be None, 'atomic' or 'deterministic'"):
            resolve_reduction(bad)


def test_deterministic_sets_every_setting():
    with deterministic() as before:
        assert isinstance(before, Settings)
        assert is_deterministic()
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()
        assert not torch.utils.deterministic.fill_uninitialized_memory
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert os.environ["MAMBA_DETERMINISTIC"] == "1"
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.get_float32_matmul_precision() == "highest"
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
        assert autotune.policy() == "pinned"


def _unusual_settings(monkeypatch):
    """Every setting away from the switch's values, and all but the fill of new tensors (a bool, left at torch's
    default True, which the switch turns off) away from torch's defaults too, so a restore is visible."""
    set_deterministic(False)                                     # mambalab's reductions atomic
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    monkeypatch.delenv("MAMBA_DETERMINISTIC", raising=False)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("medium")
    torch.backends.cudnn.deterministic = False
    torch.backends.cudnn.benchmark = True
    return Settings.capture()


@pytest.fixture
def restore_settings():
    saved = Settings.capture()
    yield
    saved.apply()


@pytest.mark.parametrize("how", ["exit", "exception", "set_deterministic"])
def test_deterministic_restores_every_setting(how, monkeypatch, restore_settings):
    before = _unusual_settings(monkeypatch)
    assert before.cublas_workspace_config == ":16:8" and before.float32_matmul_precision == "medium"
    if how == "exit":
        with deterministic():
            assert Settings.capture() != before
    elif how == "exception":
        with pytest.raises(KeyError):
            with deterministic():
                raise KeyError("boom")
    else:
        with deterministic():
            set_deterministic(False)                                 # changed inside: still restored on exit
            set_deterministic(True)
    after = Settings.capture()
    assert after == before, {k: (v, getattr(after, k)) for k, v in vars(before).items() if getattr(after, k) != v}
    assert "MAMBA_DETERMINISTIC" not in os.environ                          # unset before, unset again


def test_mamba_ssm_mode_is_switched_and_restored(restore_settings):
    from mambalab import oracle

    mamba = oracle.module("utils.determinism")
    mamba.set_deterministic_mode(None)
    with deterministic():
        assert mamba.use_deterministic_mode() and mamba._deterministic_override is True
    assert mamba._deterministic_override is None
    set_deterministic(False)
    assert mamba._deterministic_override is False and not mamba.use_deterministic_mode()


def test_set_deterministic_rejects_non_bools():
    with pytest.raises(TypeError, match="flag must be a bool"):
        set_deterministic(1)


def test_fingerprint_environment_records_tritons_bit_changing_settings(monkeypatch):
    """A saved step names the Triton settings that change mambalab's bits, so that two files that differ can be
    told apart from two machines that ran with other settings."""
    from mambalab.determinism import step

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    env = step.environment()
    assert env["triton_env"] == {"TRITON_DEFAULT_FP_FUSION": "0", "TRITON_F32_DEFAULT": None}
    report = {"fingerprint": "f", "output": "o", "loss": 0.0, "loss_hex": "0x0", "parameters": {}, "seed": 0,
              "reduction": "deterministic", "kernel_dtype": "float32", "dot_precision": "ieee", "device": "cpu",
              "size": {}, "emulated": None, "environment": env, "settings": {}}
    assert "TRITON_DEFAULT_FP_FUSION=0, TRITON_F32_DEFAULT=unset" in step.format_report(report)
