"""The sequence-split cost formulas of mambalab.parallel.cost: sequence parallelism against context parallelism,
the saved-activation count and the memory model. The formulas are checked against small cases computed by
hand and against the tensors mambalab.parallel.context really sends, recorded by a stand-in for
torch.distributed that runs three ranks one after another in this process."""
import collections
import types

import pytest
import torch

import mambalab  # noqa: F401  (before triton)
from mambalab.modules.lm import Block, LMConfig
from mambalab.modules.mamba2 import Mamba2
from mambalab.modules.norm import GatedRMSNorm
from mambalab.parallel import collectives, context
from mambalab.parallel.cost import (activation_bytes_per_token, context_parallel_communication, layer_parameters,
                                    memory_model, saved_activation_bytes, sequence_split_bytes)

TINY = LMConfig()   # d_model 32, expand 2, headdim 8, d_state 16, ngroups 4, d_conv 4, chunk 16, 2 layers


def test_context_parallel_bytes_by_hand():
    # b 1, h 2, p 3, n 5: state 4·1·2·3·5 = 120 bytes;
    # conv_dim 7, d_conv 4: halo 7·3 = 21 numbers, 42 bytes in bf16 forward; backward 21 inputs and 21 output
    # gradients, 168 bytes in fp32
    got = context_parallel_communication(1, 2, 3, 5, 7, 4, cp=2, element_size=2)
    assert got == {"state_bytes": 120, "halo_forward_bytes": 42, "halo_backward_bytes": 168, "forward_bytes": 162,
                   "backward_bytes": 288}
    assert set(context_parallel_communication(1, 2, 3, 5, 7, 4, cp=1).values()) == {0}   # no cut, nothing sent


def test_mamba2_2_7b_state_is_the_docstrings_2_6_mb():
    # b 1, h 80, p 64, n 128, fp32: 80·64·128·4 = 2,621,440 bytes (context.py's module docstring: 2.6 MB)
    assert context_parallel_communication(1, 80, 64, 128, 5376, 4, cp=4)["state_bytes"] == 2_621_440


def test_sequence_split_bytes_by_hand():
    # TINY: d_model 32; T = 4, b·l = 64 tokens, bf16. Each of the all-gather and reduce-scatter moves
    # (T - 1)/T · 64·32·2 = 3072 bytes; two a pass, two passes: 12,288.
    # CP: h = 64/8 = 8 heads, p 8, n 16: state 4·8·8·16 = 4096; conv_dim 64 + 2·4·16 = 192: halo 192·3 = 576
    # numbers, 1152 bytes forward (bf16); backward 576 inputs and 576 output gradients, 4608 bytes (fp32):
    # 4096 + 1152 + 4096 + 4608 = 13,952.
    got = sequence_split_bytes(TINY, batch=1, seqlen=64, degree=4)
    assert got["sequence_parallel_bytes"] == 12_288
    assert got["context_parallel_bytes"] == 13_952
    longer = sequence_split_bytes(TINY, batch=1, seqlen=64 * 16, degree=4)
    assert longer["sequence_parallel_bytes"] == 16 * 12_288                 # O(l)
    assert longer["context_parallel_bytes"] == 13_952                       # independent of l
    assert got["context_parallel_gradient_bytes"] == 3 * layer_parameters(TINY) * 4


def test_layer_parameters_counts_a_real_block():
    torch.manual_seed(0)
    block = Block(GatedRMSNorm(TINY.d_model), Mamba2(TINY.d_model, **TINY.mixer_kwargs(), layer_idx=0))
    assert layer_parameters(TINY) == sum(p.numel() for p in block.parameters())


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="cp must be a positive int"):
        context_parallel_communication(1, 2, 3, 5, 7, 4, cp=0)
    with pytest.raises(ValueError, match="seqlen must be a positive int"):
        sequence_split_bytes(TINY, batch=1, seqlen=0, degree=2)
    with pytest.raises(ValueError, match="activation_bytes_per_token_layer"):
        memory_model(TINY, 10, float("nan"))


class _FakeDist:
    """torch.distributed's calls that context.py makes, for ranks of one process run one after another: sends
    go to queues and are recorded (sender, receiver, bytes); every rank agrees on sizes."""

    def __init__(self, world: int):
        self.world, self.rank = world, 0
        self.queues, self.sent = collections.defaultdict(collections.deque), []

    def is_initialized(self):
        return True

    def get_rank(self, group=None):
        return self.rank

    def get_world_size(self, group=None):
        return self.world

    def all_gather(self, rows, mine, group=None):
        for row in rows:
            row.copy_(mine)

    def isend(self, tensor, dst, group=None):
        self.sent.append((self.rank, dst, tensor.numel() * tensor.element_size()))
        self.queues[(self.rank, dst)].append(tensor.clone())
        return types.SimpleNamespace(wait=lambda: None)

    def recv(self, tensor, src, group=None):
        tensor.copy_(self.queues[(src, self.rank)].popleft())


def _sent_by_three_ranks(monkeypatch, step) -> dict:
    """Runs step(lo, hi) forwards on ranks 0, 1, 2 of a sequence of 48 positions (cuts at 16 and 32), then the
    backwards from rank 2 to rank 0; returns {(sender, receiver): bytes} summed over the sends."""
    fake = _FakeDist(3)
    monkeypatch.setattr(context, "dist", fake)
    monkeypatch.setattr(collectives, "dist", fake)
    losses = []
    for r in range(3):
        fake.rank = r
        losses.append(step(16 * r, 16 * (r + 1)))
    for r in reversed(range(3)):
        fake.rank = r
        losses[r].backward()
    total = collections.Counter()
    for src, dst, nbytes in fake.sent:
        total[(src, dst)] += nbytes
    return dict(total)


def test_the_ssd_ring_sends_the_formulas_state(monkeypatch):
    b, h, p, g, n, L = 2, 3, 4, 1, 8, 48
    gen = torch.Generator().manual_seed(0)
    x, dt = torch.randn(b, L, h, p, generator=gen), torch.randn(b, L, h, generator=gen) - 1
    B, C = torch.randn(b, L, g, n, generator=gen), torch.randn(b, L, g, n, generator=gen)
    A = -torch.rand(h, generator=gen) - 0.5

    def step(lo, hi):
        xs = x[:, lo:hi].clone().requires_grad_()
        return context.context_parallel_ssd(xs, dt[:, lo:hi], A, B[:, lo:hi], C[:, lo:hi], 16,
                                            dt_softplus=True).square().sum()

    sent = _sent_by_three_ranks(monkeypatch, step)
    want = context_parallel_communication(b, h, p, n, conv_dim=1, d_conv=2, cp=3)["state_bytes"]
    assert want == 4 * 2 * 3 * 4 * 8
    # rank 1 (both neighbours): one state forward to rank 2, one gradient backward to rank 0
    assert sent == {(0, 1): want, (1, 2): want, (2, 1): want, (1, 0): want}


def test_the_conv_halo_is_the_formulas(monkeypatch):
    b, conv_dim, width, L = 2, 6, 4, 48
    gen = torch.Generator().manual_seed(1)
    u = torch.randn(b, conv_dim, L, generator=gen).to(torch.bfloat16)
    weight = torch.randn(conv_dim, width, generator=gen)

    def step(lo, hi):
        us = u[..., lo:hi].clone().requires_grad_()
        return context.context_parallel_conv1d(us, weight, activation="silu").float().square().sum()

    sent = _sent_by_three_ranks(monkeypatch, step)
    got = context_parallel_communication(b, 1, 1, 1, conv_dim, width, cp=3, element_size=2)
    assert got["halo_forward_bytes"] == 2 * 6 * 3 * 2 and got["halo_backward_bytes"] == 2 * 6 * (2 * 3) * 4
    assert sent == {(0, 1): got["halo_forward_bytes"], (1, 2): got["halo_forward_bytes"],
                    (2, 1): got["halo_backward_bytes"], (1, 0): got["halo_backward_bytes"]}


def test_saved_bytes_of_a_linear_then_silu_by_hand():
    # Linear(4, 8) saves its input (2·3·4 fp32 = 96 bytes) and its weight (a parameter: not counted);
    # SiLU saves its input, the linear's output (2·3·8 fp32 = 192 bytes): 288
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.SiLU())
    assert saved_activation_bytes(net, torch.randn(2, 3, 4, requires_grad=True)) == 288


def test_saved_bytes_count_a_storage_once():
    class Twice(torch.nn.Module):
        def forward(self, x):
            return x.sin() * x.view(-1).view(x.shape).cos()   # sin and cos both save x (one storage)

    x = torch.randn(5, 7, requires_grad=True)
    assert saved_activation_bytes(Twice(), x) == 5 * 7 * 4 * 3   # x once, and sin(x), cos(x) kept by the product


def test_saved_bytes_without_grad_is_an_error():
    with pytest.raises(ValueError, match="nothing requires grad"):
        saved_activation_bytes(torch.nn.SiLU(), torch.randn(3))


def test_a_blocks_saved_bytes_grow_by_the_same_rate_per_token_from_one_chunk_to_two_and_two_to_four():
    rate = activation_bytes_per_token(TINY, 16)
    assert rate == activation_bytes_per_token(TINY, 32)
    # at least the tensors of the block that grow with l and must be kept: its input (d_model fp32 numbers a
    # token) and in_proj's output (2·d_inner + 2·g·n + h numbers a token)
    assert rate >= 4 * (32 + 2 * 64 + 2 * 4 * 16 + 8)


def test_memory_model_by_hand():
    params = TINY.num_parameters()
    got = memory_model(TINY, tokens=1000, activation_bytes_per_token_layer=10.0, tp=2, cp=1)
    assert got["static_bytes"] == 16 * params / 2
    assert got["activation_bytes"] == 10.0 * 2 * 1000 / 2
    cp4 = memory_model(TINY, tokens=1000, activation_bytes_per_token_layer=10.0, cp=4)
    assert cp4["static_bytes"] == 16 * params                             # CP replicates the training state
    assert cp4["activation_bytes"] == 10.0 * 2 * 1000 / 4
    assert cp4["total_bytes"] == cp4["static_bytes"] + cp4["activation_bytes"]


def test_the_exercise_checker_takes_the_hand_computed_cut(capsys):
    from mambalab.exercises import ch06

    # mamba2-2.7b, b 1: state 80·64·128·4 = 2,621,440; halo 5376·3·2 = 32,256; together 2,653,696
    assert ch06.context_parallel_bytes_per_cut(2_653_696) is True
    assert ch06.context_parallel_bytes_per_cut(2_621_440) is False      # the state alone
    assert ch06.context_parallel_bytes_per_cut(None) is False
    assert "✓" in capsys.readouterr().out
