"""Packed (variable-length) sequences in mambalab's SSD, causal conv and Mamba2 block: ``seq_idx``, ``cu_seqlens``
and ``return_varlen_states``.

A row of packed sequences gives each sequence what it gets alone (outputs, final states, gradients), in both
reduction modes; boundaries sit at every position of a chunk, on chunk edges, and between sequences of one
position; the deterministic mode repeats bit for bit; each sequence's varlen state is its final state alone;
``initial_states`` is the state before sequence 0 only (mamba-ssm's rule); bad packed arguments are named
before any launch. On the CPU the kernels run in Triton's interpreter, so every size is tiny."""
import pytest
import torch

from mambalab.kernels import ssd as kernels
from mambalab.modules import Mamba2
from mambalab.modules.conv import causal_conv1d, varlen_conv_states
from mambalab.ops.ssd import ssd_chunk_scan, ssd_chunk_scan_forward
from mambalab.ref.ssd import ssd_ref

from conftest import KERNEL_DEVICE, make_ssd_inputs, requires_gpu

NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")
PER_POSITION = ("x", "dt", "B", "C", "z")          # gradients concatenated over the sequences
SHARED = ("A", "D", "dt_bias")                      # gradients summed over the sequences
Q = 16
LENGTHS = (5, 11, 1, 16, 7)   # boundaries at 5, 16 (a chunk edge), 17, 33 (inside chunks): l = 40, 3 chunks


def seq_idx_of(lengths, device=KERNEL_DEVICE):
    """(1, Σ lengths) int32: sequence i at its positions."""
    return torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32),
                                   torch.tensor(lengths))[None].to(device)


def cu_seqlens_of(lengths, device=KERNEL_DEVICE):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def run(fn, inp, dout, dfinal, chunk=Q, **kw):
    """(out, final, gradients of <out, dout> + <final, dfinal> for every input given) through ``fn``."""
    leaves = {k: (v.detach().clone().requires_grad_() if v is not None else None) for k, v in inp.items()}
    out, final = fn(*(leaves[k] for k in NAMES[:5]), chunk, return_final_states=True, dt_softplus=True,
                    **{k: leaves[k] for k in NAMES[5:]}, **kw)
    ((out * dout).sum() + (final * dfinal).sum()).backward()
    return out.detach(), final.detach(), {k: v.grad for k, v in leaves.items() if v is not None}


def compare_with_reference(inp, seq, dout, dfinal, reduction, method):
    """The op with seq_idx against ssd_ref's ``method`` form on the CPU (out, final state, every gradient);
    returns the op's (out, final, gradients)."""
    got = run(ssd_chunk_scan, inp, dout, dfinal, seq_idx=seq, reduction=reduction)
    ref = lambda *a, **kw: ssd_ref(*a, method=method, **kw)
    cpu = {k: v.cpu() if v is not None else None for k, v in inp.items()}
    want, want_final, want_g = run(ref, cpu, dout.cpu(), dfinal.cpu(), seq_idx=seq.cpu())
    assert_close(got[0], want, "out")
    assert_close(got[1], want_final, "final_states")
    for k, v in want_g.items():
        assert_close(got[2][k], v, f"d{k}")
    return got


def split(t, lengths):
    return t.split(list(lengths), dim=1)


@pytest.fixture(scope="module")
def packed_inputs():
    lengths = LENGTHS
    l = sum(lengths)
    inp = make_ssd_inputs(1, l, 2, 8, 1, 16, device=KERNEL_DEVICE)
    gen = torch.Generator().manual_seed(3)
    dout = torch.randn(1, l, 2, 8, generator=gen).to(KERNEL_DEVICE)
    dfinal = torch.randn(1, 2, 8, 16, generator=gen).to(KERNEL_DEVICE)
    return lengths, inp, dout, dfinal


@pytest.fixture(scope="module")
def alone(packed_inputs):
    """Each sequence run alone through the kernels: (outs, finals, grads); sequence 0 starts from
    initial_states, the others from zero; only the last sequence's final state gets dfinal."""
    lengths, inp, dout, dfinal = packed_inputs
    outs, finals, grads = [], [], []
    for i, (piece, d) in enumerate(zip(zip(*(split(inp[k], lengths) for k in PER_POSITION)), split(dout, lengths))):
        one = dict(zip(PER_POSITION, piece), A=inp["A"], D=inp["D"], dt_bias=inp["dt_bias"],
                   initial_states=inp["initial_states"] if i == 0 else None)
        df = dfinal if i == len(lengths) - 1 else torch.zeros_like(dfinal)
        out, final, g = run(ssd_chunk_scan, one, d, df, reduction="deterministic")
        outs.append(out), finals.append(final), grads.append(g)
    return outs, finals, grads


def assert_close(got, want, msg=""):
    scale = want.abs().max().item() + 1.0
    torch.testing.assert_close(got.float().cpu(), want.float().cpu(), atol=3e-5 * scale, rtol=1e-4, msg=msg)


@pytest.mark.parametrize("reduction", ["atomic", "deterministic"])
def test_packed_row_equals_each_sequence_alone(packed_inputs, alone, reduction):
    lengths, inp, dout, dfinal = packed_inputs
    outs, finals, grads = alone
    out, final, g = run(ssd_chunk_scan, inp, dout, dfinal, seq_idx=seq_idx_of(lengths), reduction=reduction)
    assert_close(out, torch.cat(outs, dim=1), "out")
    assert_close(final, finals[-1], "final_states: the last sequence's")
    for k in PER_POSITION:
        assert_close(g[k], torch.cat([gi[k] for gi in grads], dim=1), f"d{k}")
    for k in SHARED:
        assert_close(g[k], sum(gi[k] for gi in grads), f"d{k}")
    assert_close(g["initial_states"], grads[0]["initial_states"], "dinitial_states: sequence 0's")


def test_varlen_states_are_each_sequences_final_state(packed_inputs, alone):
    lengths, inp, _, _ = packed_inputs
    _, finals, _ = alone
    args = [inp[k] for k in NAMES]
    seq, cu = seq_idx_of(lengths), cu_seqlens_of(lengths)
    out, varlen = ssd_chunk_scan_forward(*args[:5], Q, *args[5:], seq, cu, True, return_varlen_states=True)
    out2, final, varlen2 = ssd_chunk_scan_forward(*args[:5], Q, *args[5:], seq, cu, True,
                                                  return_final_states=True, return_varlen_states=True)
    assert varlen.shape == (len(lengths), 2, 8, 16) and torch.equal(varlen, varlen2) and torch.equal(out, out2)
    for i, f in enumerate(finals):
        assert_close(varlen[i], f[0], f"varlen_states[{i}]")
    assert torch.equal(varlen[-1], final[0]) or torch.allclose(varlen[-1], final[0], atol=1e-5)
    # the op with gradients returns the same, in mamba-ssm's order; varlen_states carry no gradient
    x = inp["x"].detach().clone().requires_grad_()
    res = ssd_chunk_scan(x, *args[1:5], Q, *args[5:], seq, cu, True, return_varlen_states=True)
    assert len(res) == 2 and torch.equal(res[0].detach(), out) and not res[1].requires_grad
    assert torch.equal(res[1], varlen)
    res[0].sum().backward()
    assert x.grad is not None


def test_boundaries_at_every_position_of_a_chunk():
    """Row k (k = 1 … 31) splits l = 32 (two chunks) at position k; one more row is all one-position sequences
    and one is a single sequence: outputs, final states and every gradient against the reference."""
    l, rows = 2 * Q, 2 * Q + 1
    seq = torch.zeros(rows, l, dtype=torch.int32)
    for k in range(1, l):
        seq[k - 1, k:] = 1
    seq[l - 1] = torch.arange(l, dtype=torch.int32)
    seq[l] = 0                                   # no boundary: the plain scan
    seq = seq.to(KERNEL_DEVICE)
    inp = make_ssd_inputs(rows, l, 2, 8, 1, 16, device=KERNEL_DEVICE)
    gen = torch.Generator().manual_seed(5)
    dout = torch.randn(rows, l, 2, 8, generator=gen).to(KERNEL_DEVICE)
    dfinal = torch.randn(rows, 2, 8, 16, generator=gen).to(KERNEL_DEVICE)
    compare_with_reference(inp, seq, dout, dfinal, "deterministic", "quadratic")


def test_deterministic_mode_repeats_bit_for_bit(packed_inputs):
    lengths, inp, dout, dfinal = packed_inputs
    seq = seq_idx_of(lengths)
    first = run(ssd_chunk_scan, inp, dout, dfinal, seq_idx=seq, reduction="deterministic")
    second = run(ssd_chunk_scan, inp, dout, dfinal, seq_idx=seq, reduction="deterministic")
    assert torch.equal(first[0], second[0]) and torch.equal(first[1], second[1])
    for k in first[2]:
        assert torch.equal(first[2][k], second[2][k]), k


def test_initial_states_belong_to_sequence_zero_only():
    """As mamba-ssm: the initial state is the state before the sequence numbered 0. A row whose seq_idx starts
    at 1 ignores it (and gets no gradient into it); the forward-only entry agrees with the autograd op."""
    inp = make_ssd_inputs(2, 24, 2, 8, 1, 16, device=KERNEL_DEVICE)
    seq = torch.tensor([[0] * 20 + [1] * 4, [1] * 3 + [2] * 21], dtype=torch.int32, device=KERNEL_DEVICE)
    gen = torch.Generator().manual_seed(7)
    dout = torch.randn(2, 24, 2, 8, generator=gen).to(KERNEL_DEVICE)
    dfinal = torch.randn(2, 2, 8, 16, generator=gen).to(KERNEL_DEVICE)
    out, _, g = compare_with_reference(inp, seq, dout, dfinal, "atomic", "recurrent")
    assert torch.count_nonzero(g["initial_states"][1]) == 0
    with torch.no_grad():
        fwd = ssd_chunk_scan_forward(*(inp[k] for k in NAMES[:5]), Q, *(inp[k] for k in NAMES[5:]), seq, None,
                                     True)
    assert torch.equal(fwd, out)


def test_forward_sweep_masks_as_the_split_steps():
    """Steps 1-3 as one sweep (Mamba-3's forward) with seq_idx give what the split steps give."""
    inp = make_ssd_inputs(1, 40, 2, 8, 1, 16, device=KERNEL_DEVICE)
    seq = seq_idx_of(LENGTHS)
    cfg = kernels.tile_config(2, 8, 16, Q)
    delta, cs = kernels.chunk_cumsum_fwd(inp["dt"], inp["A"], inp["dt_bias"], True, (0.0, float("inf")), cfg)
    args = (inp["x"], inp["B"], inp["C"], delta, cs, inp["initial_states"], inp["D"], inp["z"], cfg, "ieee")
    split_steps = kernels.steps_1_to_3(*args, sweep=False, seq_idx=seq)
    swept = kernels.steps_1_to_3(*args, sweep=True, seq_idx=seq)
    for name, a, b in zip(("out", "entering", "final"), swept[:3], split_steps[:3]):
        assert_close(a, b, name)


# ---------------------------------------------------------------------------------------------- validation
def _inputs_and_no_launch(monkeypatch, b=1, l=16):
    def no_launch(*a, **k):
        raise AssertionError("a kernel was launched")
    monkeypatch.setattr(kernels, "ssd_chunk_scan_fwd", no_launch)
    inp = make_ssd_inputs(b, l, 2, 4, 1, 4, device=KERNEL_DEVICE)
    return [inp[k] for k in NAMES[:5]]


i32 = dict(dtype=torch.int32, device=KERNEL_DEVICE)


@pytest.mark.parametrize("op", [ssd_chunk_scan, ssd_chunk_scan_forward])
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(seq_idx=torch.zeros(1, 16, device=KERNEL_DEVICE)), TypeError, "seq_idx must have dtype int32, int64"),
    (dict(seq_idx=torch.zeros(1, 15, **i32)), ValueError, r"seq_idx must have shape \(b, l\)"),
    (dict(seq_idx=torch.zeros(1, 16, dtype=torch.int32, device="meta")), ValueError, "seq_idx is on meta"),
    (dict(seq_idx=torch.tensor([[0] * 8 + [1] * 4 + [0] * 4], **i32)), ValueError, "seq_idx must be nondecreasing"),
    (dict(seq_idx=torch.tensor([[0] * 6 + [-1] * 2 + [2] * 4 + [1] * 4], **i32)), ValueError,
     "seq_idx must be nondecreasing"),   # padding between sequences is fine; 2 then 1 is not
    (dict(return_varlen_states=True), ValueError, "return_varlen_states=True needs cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([0, 8, 16], **i32), return_varlen_states=True), ValueError,
     "2 sequences but seq_idx is None"),
    (dict(cu_seqlens=torch.tensor([1, 16], **i32), return_varlen_states=True), ValueError, "cu_seqlens must start at 0"),
    (dict(cu_seqlens=torch.tensor([0, 8, 6, 16], **i32), return_varlen_states=True), ValueError, "never decrease"),
    (dict(cu_seqlens=torch.tensor([0, 17], **i32), return_varlen_states=True), ValueError, "at most at l = 16"),
    (dict(cu_seqlens=torch.tensor([[0, 16]], **i32), return_varlen_states=True), ValueError,
     r"cu_seqlens must have shape \(num_seqs \+ 1,\)"),
    (dict(cu_seqlens=torch.tensor([0.0, 16.0], device=KERNEL_DEVICE), return_varlen_states=True), TypeError,
     "cu_seqlens must have dtype"),
])
def test_bad_packed_arguments_are_named_before_any_launch(monkeypatch, op, kwargs, error, match):
    args = _inputs_and_no_launch(monkeypatch)
    with pytest.raises(error, match=match):
        op(*args, Q, **kwargs)


def test_varlen_states_need_one_row(monkeypatch):
    args = _inputs_and_no_launch(monkeypatch, b=2)
    with pytest.raises(ValueError, match="b = 1"):
        ssd_chunk_scan(*args, Q, seq_idx=torch.zeros(2, 16, **i32), cu_seqlens=torch.tensor([0, 16], **i32),
                       return_varlen_states=True)


def test_cu_seqlens_is_read_only_for_varlen_states():
    """As in mamba-ssm: without return_varlen_states, cu_seqlens changes nothing."""
    inp = make_ssd_inputs(1, 16, 2, 4, 1, 4, device=KERNEL_DEVICE)
    args = [inp[k] for k in NAMES[:5]]
    plain = ssd_chunk_scan_forward(*args, Q)
    assert torch.equal(plain, ssd_chunk_scan_forward(*args, Q, cu_seqlens=torch.tensor([0, 8, 16], **i32)))


def test_padding_and_empty_sequences_as_mamba_ssm_marks_them():
    """mamba-ssm's padded batch: positions after the last sequence carry seq_idx -1 and cu_seqlens ends before
    l, with an empty sequence for the padding row. The sequences' outputs and states are theirs alone; the
    empty sequence's state is zero; padding between sequences is allowed too."""
    lengths, pad = (6, 13, 4), 9
    l = sum(lengths) + pad
    inp = make_ssd_inputs(1, l, 2, 8, 1, 16, init=False, device=KERNEL_DEVICE)
    args = [inp[k] for k in NAMES]
    seq = torch.cat([seq_idx_of(lengths), torch.full((1, pad), -1, **i32)], dim=1)
    cu = torch.cat([cu_seqlens_of(lengths), cu_seqlens_of(lengths)[-1:]])      # the padding: an empty sequence
    out, varlen = ssd_chunk_scan_forward(*args[:5], Q, *args[5:], seq, cu, True, return_varlen_states=True)
    assert varlen.shape == (len(lengths) + 1, 2, 8, 16) and not varlen[-1].any()
    start = 0
    for i, n in enumerate(lengths):
        one = {k: (inp[k][:, start:start + n] if k in PER_POSITION else inp[k]) for k in NAMES}
        alone, final = ssd_chunk_scan_forward(*(one[k] for k in NAMES[:5]), Q, *(one[k] for k in NAMES[5:]),
                                              dt_softplus=True, return_final_states=True)
        assert_close(out[:, start:start + n], alone, f"out of sequence {i}")
        assert_close(varlen[i], final[0], f"varlen_states[{i}]")
        start += n
    # padding between two sequences: the second is still its own
    mid = torch.cat([torch.zeros(1, 6, **i32), torch.full((1, 4), -1, **i32), torch.ones(1, l - 10, **i32)], 1)
    got = ssd_chunk_scan_forward(*args[:5], Q, *args[5:], mid, dt_softplus=True)
    tail = {k: (inp[k][:, 10:] if k in PER_POSITION else inp[k]) for k in NAMES}
    alone = ssd_chunk_scan_forward(*(tail[k] for k in NAMES[:5]), Q, *(tail[k] for k in NAMES[5:]), dt_softplus=True)
    assert_close(got[:, 10:], alone, "the sequence after padding")


def test_mamba2_with_cu_seqlens_before_the_padding():
    """Mamba2 derives seq_idx from cu_seqlens with -1 after its end (mamba-ssm's padding), keeps one decoding
    state per sequence, zero for an empty one."""
    torch.manual_seed(0)
    block = Mamba2(16, d_state=16, headdim=8, chunk_size=Q, scan="kernel").to(KERNEL_DEVICE)
    lengths, pad = (9, 14), 7
    u = torch.randn(1, sum(lengths) + pad, 16, generator=torch.Generator().manual_seed(1)).to(KERNEL_DEVICE)
    cu = torch.tensor([0, 9, 23, 23], dtype=torch.int32, device=KERNEL_DEVICE)
    cache = block.allocate_inference_cache(3)
    with torch.no_grad():
        out = block(u, cu_seqlens=cu, cache=cache)
        for i, (lo, hi) in enumerate([(0, 9), (9, 23)]):
            one = block.allocate_inference_cache(1)
            assert_close(out[:, lo:hi], block(u[:, lo:hi], cache=one), f"out of sequence {i}")
            assert_close(cache[1][i], one[1][0], f"ssm_state of sequence {i}")
    assert not cache[0][2].any() and not cache[1][2].any()


# ---------------------------------------------------------------------------------------------- the conv
def test_conv_with_seq_idx_equals_each_sequence_alone():
    torch.manual_seed(0)
    conv = torch.nn.Conv1d(6, 6, kernel_size=4, groups=6, padding=3)
    lengths = (1, 2, 5, 3, 9)
    x = torch.randn(1, 6, sum(lengths))
    seq = seq_idx_of(lengths, device="cpu")
    state = torch.zeros(1, 6, 4)
    packed = causal_conv1d(conv, x, state, seq_idx=seq)
    alone = [causal_conv1d(conv, piece) for piece in x.split(list(lengths), dim=-1)]
    torch.testing.assert_close(packed, torch.cat(alone, dim=-1), atol=1e-6, rtol=1e-5)
    assert torch.equal(causal_conv1d(conv, x, seq_idx=torch.zeros_like(seq)), causal_conv1d(conv, x)) or \
        torch.allclose(causal_conv1d(conv, x, seq_idx=torch.zeros_like(seq)), causal_conv1d(conv, x), atol=1e-6)
    windows = varlen_conv_states(x, cu_seqlens_of(lengths, device="cpu"), 4)
    for i, piece in enumerate(x.split(list(lengths), dim=-1)):
        one = torch.zeros(1, 6, 4)
        causal_conv1d(conv, piece, one)
        assert torch.equal(windows[i], one[0]), i
    assert torch.equal(state[0], windows[-1])      # the row's window: its last sequence's


# ---------------------------------------------------------------------------------------------- the block
@pytest.mark.parametrize("scan", ["kernel", "reference"])
def test_mamba2_packed_equals_each_sequence_alone(scan):
    torch.manual_seed(0)
    block = Mamba2(16, d_state=16, headdim=8, chunk_size=Q, scan=scan).to(KERNEL_DEVICE)
    lengths = (7, 1, 20, 12)
    u = torch.randn(1, sum(lengths), 16, generator=torch.Generator().manual_seed(1)).to(KERNEL_DEVICE)
    cu = cu_seqlens_of(lengths)
    packed_u = u.clone().requires_grad_()
    cache = block.allocate_inference_cache(len(lengths))
    out = block(packed_u, cu_seqlens=cu, cache=cache)
    out_seq = block(u, seq_idx=seq_idx_of(lengths))                 # seq_idx alone: the same outputs
    gen = torch.Generator().manual_seed(2)
    dout = torch.randn(out.shape, generator=gen).to(KERNEL_DEVICE)
    (out * dout).sum().backward()
    for i, (piece, d) in enumerate(zip(u.split(list(lengths), dim=1), dout.split(list(lengths), dim=1))):
        piece = piece.clone().requires_grad_()
        one = block.allocate_inference_cache(1)
        o = block(piece, cache=one)
        (o * d).sum().backward()
        lo, hi = cu[i].item(), cu[i + 1].item()
        assert_close(out[:, lo:hi].detach(), o.detach(), f"out of sequence {i}")
        assert_close(out_seq[:, lo:hi].detach(), o.detach(), f"out (seq_idx) of sequence {i}")
        assert_close(packed_u.grad[:, lo:hi], piece.grad, f"du of sequence {i}")
        assert_close(cache[0][i], one[0][0], f"conv_state of sequence {i}")
        assert_close(cache[1][i], one[1][0], f"ssm_state of sequence {i}")


def test_mamba2_names_bad_packed_arguments():
    block = Mamba2(16, d_state=16, headdim=8, chunk_size=Q, scan="reference")
    u = torch.randn(2, 8, 16)
    with pytest.raises(ValueError, match="b = 1"):
        block(u, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        block(u[:1], cu_seqlens=torch.tensor([0, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens must be"):
        block(u[:1], cu_seqlens=torch.tensor([0, 5, 3], dtype=torch.int32))
    with pytest.raises(TypeError, match="seq_idx must have dtype"):
        block(u, seq_idx=torch.zeros(2, 8))


# ---------------------------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("reduction", ["atomic", "deterministic"])
def test_packed_matches_mamba_ssm_on_gpu(reduction):
    """mamba_chunk_scan_combined with seq_idx and cu_seqlens on the same packed row, fp32 (TF32 dots on both
    sides), chunk 256. Its autotuners try their smallest configuration only (oracle.single_config(smallest=True),
    as test_ssd_kernels' and test_ssd_backward's comparisons: all of them compile for minutes on a fresh GPU and
    the first ones do not fit an H200's shared memory). Tolerances relative to the largest value, as the other
    GPU comparisons: TF32 rounds at 2^-11 of the operands, not of each output."""
    from mambalab import oracle
    combined = oracle.module("ops.triton.ssd_combined").mamba_chunk_scan_combined
    lengths = (100, 1, 255, 256, 300, 112)
    l = sum(lengths)
    inp = make_ssd_inputs(1, l, 4, 64, 1, 64, device="cuda")
    inp["initial_states"] = None
    seq, cu = seq_idx_of(lengths, "cuda"), cu_seqlens_of(lengths, "cuda")
    args = [inp[k] for k in NAMES]
    ours = ssd_chunk_scan(*args[:5], 256, *args[5:], seq, cu, True, return_final_states=True,
                          return_varlen_states=True, reduction=reduction)
    with oracle.single_config("mamba_ssm.ops.triton", smallest=True):
        theirs = combined(*args[:5], 256, *args[5:], seq, cu, True, return_final_states=True,
                          return_varlen_states=True)
    for name, a, b in zip(("out", "final_states", "varlen_states"), ours, theirs):
        scale = b.float().abs().max().item() + 1.0
        torch.testing.assert_close(a.float(), b.float(), atol=5e-3 * scale, rtol=5e-3, msg=name)
    gen = torch.Generator().manual_seed(3)
    dout = torch.randn(1, l, 4, 64, generator=gen).cuda()
    g_ours = run(ssd_chunk_scan, inp, dout, torch.zeros(1, 4, 64, 64, device="cuda"), chunk=256, seq_idx=seq,
                 reduction=reduction)[2]
    with oracle.single_config("mamba_ssm.ops.triton", smallest=True):
        g_theirs = run(combined, inp, dout, torch.zeros(1, 4, 64, 64, device="cuda"), chunk=256, seq_idx=seq)[2]
    for k in g_theirs:
        scale = g_theirs[k].abs().max().item() + 1.0
        torch.testing.assert_close(g_ours[k].float(), g_theirs[k].float(), atol=5e-3 * scale, rtol=5e-3, msg=k)
