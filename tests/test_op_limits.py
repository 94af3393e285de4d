"""The ops' size limits: a launch grid axis beyond CUDA's caps (axis 0: 2^31 - 1 programs; axes 1 and 2:
65,535) or a tensor past the kernels' 32-bit offsets is a ValueError at the op's boundary that says what is
too large, the limit and what would fit, raised before any kernel launches.

The huge inputs are expanded views of one element (``torch.empty(1).expand(...)``): they take no memory, and
the checks never copy them (the NaN check of delta / dt reads each distinct element once)."""
import importlib

import pytest
import torch

import mambalab.kernels.mamba3 as mamba3_kernels
import mambalab.kernels.selective_scan as scan_kernels
import mambalab.kernels.ssd as ssd_kernels
import mambalab.ops.ssd as ops_ssd
from mambalab import validate
from mambalab.ops import mamba3_chunk_scan, mamba3_step, selective_scan, ssd_chunk_scan, ssd_chunk_scan_forward
from mambalab.ref.mamba3 import Mamba3State

from conftest import KERNEL_DEVICE

ops_selective_scan = importlib.import_module("mambalab.ops.selective_scan")   # the package's attribute is the op


class Launched(Exception):
    """Raised by a stubbed launcher: the op's checks passed and it went on to launch."""


def _no_launch(*args, **kwargs):
    raise Launched


@pytest.fixture
def no_launch(monkeypatch):
    """Every launcher the ops call raises :class:`Launched`, and so does the step just before the launch
    where the ops make the kernels' inputs contiguous (which would copy an expanded view): a test here
    never runs a kernel or allocates a huge tensor, and ``Launched`` means every check passed."""
    monkeypatch.setattr(scan_kernels, "selective_scan_fwd", _no_launch)
    monkeypatch.setattr(ssd_kernels, "ssd_chunk_scan_fwd", _no_launch)
    for name in ("angle_cumsum_fwd", "mamba3_step_fwd"):
        monkeypatch.setattr(mamba3_kernels, name, _no_launch)
    monkeypatch.setattr(ops_selective_scan.SelectiveScanFn, "apply", _no_launch)
    monkeypatch.setattr(ops_ssd.SSDChunkScanFn, "apply", _no_launch)
    monkeypatch.setattr(ops_ssd, "_prepare", _no_launch)


def huge(*shape, value=0.0, requires_grad=False):
    """A (shape) fp32 tensor of ``value`` that takes one element of memory (an expanded view)."""
    one = torch.full((1,), value, device=KERNEL_DEVICE, requires_grad=requires_grad)
    return one.expand(*shape)


def scan_inputs(b, d, n, l, requires_grad=False):
    u = huge(b, d, l, requires_grad=requires_grad)
    return u, huge(b, d, l, value=0.1), huge(d, n, value=-1.0), huge(b, n, l), huge(b, n, l)


def ssd_inputs(b, l, h, p, g=1, n=16, requires_grad=False):
    x = huge(b, l, h, p, requires_grad=requires_grad)
    return x, huge(b, l, h, value=0.1), huge(h, value=-1.0), huge(b, l, g, n), huge(b, l, g, n)


# ---------------------------------------------------------------------------------------------- helpers
def test_launch_grid_names_the_size_the_limit_and_what_fits():
    validate.launch_grid("k", (2**31 - 1, 65_535, 65_535), (("b", 1), ("c", 1), ("h", 1)))   # at the caps: fine
    with pytest.raises(ValueError, match=r"h = 70,000 is too large for k: it launches 140,000 programs on grid "
                                         r"axis 2, and CUDA takes at most 65,535 there; h = 32,767 or less would fit"):
        validate.launch_grid("k", (1, 1, 140_000), (("b", 1), ("c", 1), ("h", 70_000)))
    with pytest.raises(ValueError, match="grid axis 0.*at most 2,147,483,647"):
        validate.launch_grid("k", (2**31, 1), (("b", 2**31), ("d", 1)))


@pytest.mark.parametrize("value, per", [(70_000, 2), (100_003, 3), (2**21 + 5, 16)])
def test_the_size_said_to_fit_does_fit_and_one_more_does_not_always(value, per):
    """The suggested size keeps the grid within the cap, whether the programs are value · per or a ceiling
    division value / per."""
    for programs_of in (lambda v: v * per, lambda v: -(-v // per)):
        programs = programs_of(value)
        if programs <= 65_535:
            continue
        with pytest.raises(ValueError) as info:
            validate.launch_grid("k", (1, programs), (("b", 1), ("h", value)))
        fit = int(str(info.value).split("; h = ")[1].split(" or less")[0].replace(",", ""))
        assert programs_of(fit) <= 65_535
        validate.launch_grid("k", (1, programs_of(fit)), (("b", 1), ("h", fit)))


def test_int32_offsets_name_the_tensor_and_what_fits():
    validate.int32_offsets("t", 2**31 - 1, ("b", 1))
    with pytest.raises(ValueError, match=r"t would have 2,147,483,648 entries, more than the 2,147,483,647 .*"
                                         r"32-bit offsets: b = 4 is too large; b = 3 or less would fit"):
        validate.int32_offsets("t", 2**31, ("b", 4))


def test_distinct_elements_drops_expanded_axes_without_copying():
    base = torch.arange(3.0)
    x = base[None, :, None].expand(1000, 3, 1000)
    view = validate.distinct_elements(x)
    assert view.shape == (1, 3, 1) and view.data_ptr() == base.data_ptr()
    assert torch.equal(view.flatten(), base)
    plain = torch.randn(2, 3)
    assert validate.distinct_elements(plain) is plain


def test_finite_reads_an_expanded_tensor_once():
    """A NaN in a 2^40-element expanded view is found at the cost of one element (a copy or a full
    reduction of it would not finish)."""
    bad = torch.full((1,), float("nan")).expand(2**20, 2**20)
    with pytest.raises(ValueError, match="delta contains NaN"):
        validate.finite("delta", bad)
    validate.finite("delta", torch.zeros(1).expand(2**20, 2**20))


# ---------------------------------------------------------------------------------------------- selective scan
def test_selective_scan_channels_beyond_grid_axis_1(no_launch):
    with pytest.raises(ValueError, match=r"d \(u.shape\[1\]\) = 65,536 is too large for the selective-scan "
                                         r"forward.*grid axis 1.*at most 65,535.*d \(u.shape\[1\]\) = 65,535 or less"):
        selective_scan(*scan_inputs(1, 65_536, 4, 16))
    with pytest.raises(Launched):   # one channel fewer passes every check
        selective_scan(*scan_inputs(1, 65_535, 4, 16))


def test_selective_scan_state_checkpoints_beyond_int32(no_launch):
    """b · (checkpoints + 1) · d rows of the state checkpoints: 2^16 · 2 · 2^14 = 2^31 (l = 16: one block)."""
    with pytest.raises(ValueError, match=r"the state checkpoints .* would have 2,147,483,648 entries.*32-bit "
                                         r"offsets: b \(u.shape\[0\]\) = 65,536 is too large; b \(u.shape\[0\]\) = 65,535 or less"):
        selective_scan(*scan_inputs(2**16, 2**14, 1, 16))
    with pytest.raises(Launched):
        selective_scan(*scan_inputs(2**16 - 1, 2**14, 1, 16))


def test_selective_scan_delta_check_does_not_copy_an_expanded_delta(no_launch):
    """u and delta of 2^34 elements each, expanded from one: the checks pass and reach the launch."""
    with pytest.raises(Launched):
        selective_scan(*scan_inputs(2**10, 2**12, 1, 2**12))


# ---------------------------------------------------------------------------------------------- SSD
@pytest.mark.parametrize("op", [ssd_chunk_scan, ssd_chunk_scan_forward])
def test_ssd_heads_beyond_grid_axis_2(op, no_launch):
    with pytest.raises(ValueError, match=r"h \(x.shape\[2\]\) = 65,536 is too large for the SSD chunk states: "
                                         r"it launches 65,536 programs on grid axis 2"):
        op(*ssd_inputs(1, 16, 65_536, 1), 16)


def test_ssd_chunk_scan_grid_grows_with_the_chunk_size(no_launch):
    """The chunk scan launches h · q / BLOCK_T · p / BLOCK_P programs on axis 2: h = 16,384 heads fit the
    chunk states' grid (h · 1) but not the chunk scan's at q = 256 (h · 4); 16,383 would."""
    with pytest.raises(ValueError, match=r"h \(x.shape\[2\]\) = 16,384 is too large for the SSD chunk scan: it "
                                         r"launches 65,536 programs.*16,383 or less would fit"):
        ssd_chunk_scan_forward(*ssd_inputs(1, 16, 16_384, 64), 256)
    with pytest.raises(Launched):
        ssd_chunk_scan_forward(*ssd_inputs(1, 16, 16_383, 64), 256)


def test_ssd_backward_limits_are_checked_when_a_gradient_is_wanted(no_launch):
    """fp32's backward takes 32 positions a program, the forward 64: at h = 10,000 and q = 256 the forward
    grids fit (40,000 programs) and the backward's chunk scan (80,000) does not."""
    with pytest.raises(Launched):
        ssd_chunk_scan(*ssd_inputs(1, 16, 10_000, 16), 256)
    with pytest.raises(ValueError, match=r"h \(x.shape\[2\]\) = 10,000 is too large for the SSD chunk-scan "
                                         r"backward: it launches 80,000 programs"):
        ssd_chunk_scan(*ssd_inputs(1, 16, 10_000, 16, requires_grad=True), 256)


def test_ssd_positions_beyond_int32(no_launch):
    with pytest.raises(ValueError, match=r"the positions \(b, l\) = \(65536, 32768\) would have 2,147,483,648 "
                                         r"entries.*b \(x.shape\[0\]\) = 65,536 is too large"):
        ssd_chunk_scan_forward(*ssd_inputs(2**16, 2**15, 1, 1), 16)


@pytest.mark.parametrize("op", [ssd_chunk_scan, ssd_chunk_scan_forward])
def test_ssd_expanded_inputs_are_sized_before_anything_is_allocated(op, no_launch, monkeypatch):
    """x expanded from one element to b · l · h · p = 2^16 · 2^8 · 129 entries (more than 2^31): its contiguous
    fp32 copy takes 8.66 GB, the output as much, dt's copy 0.07 GB: 17.4 GB. With 16 GB available the op must
    refuse, naming x and the sizes, before _prepare copies anything (the stubbed _prepare raises Launched)."""
    monkeypatch.setattr(validate, "available_bytes", lambda device: 16 * 10**9)
    inputs = ssd_inputs(1, 2**16, 2**8, 2**7 + 1)
    with pytest.raises(ValueError, match=r"the SSD chunk scan needs 17.4 GB before its kernels run, \S+ has 16.0 GB "
                                         r"available: contiguous copies of x \(8.7 GB\) \(the kernels.*split the batch"):
        op(*inputs, 256)
    monkeypatch.setattr(validate, "available_bytes", lambda device: 18 * 10**9)
    with pytest.raises(Launched):   # the same call where the memory is there
        op(*inputs, 256)


def test_copies_fit_counts_only_what_is_copied():
    cpu = torch.device("cpu")
    plain = torch.zeros(4, 4)
    validate.copies_fit("op", cpu, [("x", plain, torch.float32)], outputs=0)     # read in place: nothing needed
    big = torch.zeros(1).expand(2**40)
    with pytest.raises(ValueError, match=r"op needs 4398.0 GB .*copies of x \(4398.0 GB\)"):
        validate.copies_fit("op", cpu, [("x", big, torch.float32)], outputs=0)


# ---------------------------------------------------------------------------------------------- Mamba-3
def mamba3_inputs(b, l, h, p=16, n=16, per_token=False):
    seq = () if per_token else (l,)
    return dict(q=huge(b, *seq, 1, 1, n), k=huge(b, *seq, 1, 1, n), v=huge(b, *seq, h, p),
                adt=huge(b, *seq, h, value=-0.1), dt=huge(b, *seq, h, value=0.1), trap=huge(b, *seq, h, value=0.5),
                q_bias=huge(h, 1, n), k_bias=huge(h, 1, n), angles=huge(b, *seq, h, 2))


def test_mamba3_heads_beyond_grid_axis_1(no_launch):
    with pytest.raises(ValueError, match=r"h \(v.shape\[-2\]\) = 65,536 is too large for the Mamba-3 kernels"):
        mamba3_chunk_scan(**mamba3_inputs(1, 16, 65_536), chunk_size=16)
    state = Mamba3State(huge(1, 65_536, 2), huge(1, 65_536, 16, 16), huge(1, 65_536, 1, 16), huge(1, 65_536, 16))
    with torch.no_grad(), pytest.raises(ValueError, match=r"h \(v.shape\[-2\]\) = 65,536 is too large"):
        mamba3_step(state, **mamba3_inputs(1, 1, 65_536, per_token=True))


def test_mamba3_rank_expanded_positions_beyond_int32(no_launch):
    """The chunked scan runs the SSD kernels on b · l · r positions."""
    inp = mamba3_inputs(2**16, 2**15, 1)
    with pytest.raises(ValueError, match=r"the positions \(b, l\) = \(65536, 32768\) would have"):
        mamba3_chunk_scan(**inp, chunk_size=16)


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every ATen op that runs (on a GPU, each is a kernel launch or a copy back)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def test_mamba3_nan_dt_is_found_before_anything_else_runs():
    """A NaN in dt, packed sequences, bf16 inputs (cast to fp32 for the interpreter, and on a GPU the step
    sizes, biases and angles to fp32): the op runs exactly the ops of the finite check and raises; no cast,
    no seq_idx, no kernel comes first."""
    from conftest import make_mamba3_inputs

    inp = {k: t.to(KERNEL_DEVICE, torch.bfloat16) for k, t in make_mamba3_inputs(1, 32, 2, 16, 1, 16, 1, 2).items()
           if t is not None}
    inp["dt"][0, 5, 1] = float("nan")
    cu_seqlens = torch.tensor([0, 20, 32], device=KERNEL_DEVICE, dtype=torch.int32)
    with _Ops() as alone, pytest.raises(ValueError, match="dt contains NaN"):
        validate.finite("dt", inp["dt"])
    with torch.no_grad(), _Ops() as op, pytest.raises(ValueError, match="dt contains NaN"):
        mamba3_chunk_scan(**inp, chunk_size=16, cu_seqlens=cu_seqlens)
    assert op.ops == alone.ops, op.ops
