"""mambalab.oracle: narrowing mamba-ssm's autotuners for numerical comparisons (first_configs_only)."""
import sys
import types

import pytest
import triton
import triton.language as tl

from mambalab import oracle


@triton.autotune(configs=[triton.Config({"BLOCK": b}, num_warps=w) for b in (16, 32) for w in (2, 4)], key=["n"])
@triton.jit
def _double_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, 2 * tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@pytest.fixture
def fake_rival(monkeypatch):
    """A module named like one of the rival's, holding an autotuner (and one more name for the same object)."""
    mod = types.ModuleType("fake_rival.ops.kernels")
    mod.kernel, mod.alias = _double_kernel, _double_kernel
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod


def test_first_configs_only_narrows_then_restores(fake_rival):
    configs = list(_double_kernel.configs)
    assert oracle.autotuners("fake_rival") == [_double_kernel]          # once, though two names hold it
    assert oracle.autotuners("other_prefix") == []
    with oracle.first_configs_only("fake_rival") as tuners:
        assert tuners == [_double_kernel]
        assert _double_kernel.configs == configs[:1]
    assert _double_kernel.configs == configs
    with pytest.raises(RuntimeError, match="inside"):
        with oracle.first_configs_only("fake_rival"):
            raise RuntimeError("inside")
    assert _double_kernel.configs == configs                            # restored after an error too
