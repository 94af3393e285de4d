"""mambalab.oracle: narrowing mamba-ssm's autotuners for numerical comparisons (single_config: the first
configuration, or the smallest)."""
import sys
import types

import pytest
import triton
import triton.language as tl

from mambalab import oracle


@triton.autotune(configs=[triton.Config({"BLOCK_SIZE_M": b, "BLOCK_SIZE_N": 16}, num_warps=w, num_stages=s)
                          for b, s in ((32, 2), (16, 3), (16, 1)) for w in (2, 4)], key=["n"])
@triton.jit
def _double_kernel(x_ptr, n, BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)
    tl.store(x_ptr + offs, 2 * tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)


@pytest.fixture
def fake_rival(monkeypatch):
    """A module named like one of the rival's, holding an autotuner (and one more name for the same object)."""
    mod = types.ModuleType("fake_rival.ops.kernels")
    mod.kernel, mod.alias = _double_kernel, _double_kernel
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    return mod


def test_single_config_narrows_then_restores(fake_rival):
    configs = list(_double_kernel.configs)
    assert oracle.autotuners("fake_rival") == [_double_kernel]          # once, though two names hold it
    assert oracle.autotuners("other_prefix") == []
    with oracle.single_config("fake_rival") as tuners:
        assert tuners == [_double_kernel]
        assert _double_kernel.configs == configs[:1]
    assert _double_kernel.configs == configs
    with pytest.raises(RuntimeError, match="inside"):
        with oracle.single_config("fake_rival"):
            raise RuntimeError("inside")
    assert _double_kernel.configs == configs                            # restored after an error too


def test_smallest_config_is_the_cheapest_by_blocks_and_stages(fake_rival):
    """``smallest=True`` keeps the configuration with the least BLOCK_SIZE_* product times stages: (16, 16) at
    one stage here, the fifth of six; the first, (32, 16) at two stages, is four times its cost."""
    configs = list(_double_kernel.configs)
    assert [oracle.block_cost(c) for c in configs] == [1024, 1024, 768, 768, 256, 256]
    with oracle.single_config("fake_rival", smallest=True):
        assert _double_kernel.configs == [configs[4]]
    assert _double_kernel.configs == configs
