"""mambalab.viz.parallel_plots and mambalab.parallel.cost: the figures draw what the layers hold and cost."""
import mambalab  # noqa: F401
from mambalab.modules.lm import LMConfig
import pytest

from mambalab.parallel.cost import allreduce_bytes, collectives_per_layer, layer_communication, memory_per_rank
from mambalab.viz.parallel_plots import communication_figure, curves_figure, memory_figure, split_figure, tp_cost_figure


def test_split_figure_gives_each_rank_an_equal_share_of_every_piece():
    d_inner, g, n, h, tp = 64, 4, 16, 8, 4
    fig = split_figure(tp, d_inner, g, n, h, d_model=32)
    held = {}
    for bar in fig.data:
        held.setdefault((bar.y[0], bar.name), 0)
        held[(bar.y[0], bar.name)] += bar.x[0]
    in_rows = 2 * d_inner + 2 * g * n + h
    for r in range(tp):
        assert held[(fig.data[0].y[0], f"rank {r}")] == in_rows // tp
        assert held[(fig.data[-1].y[0], f"rank {r}")] == d_inner // tp
    assert fig.layout.title.text and fig.layout.xaxis.title.text and fig.layout.yaxis.title.text


def test_memory_per_rank_splits_everything_but_the_norms():
    cfg = LMConfig(vocab_size=64, d_model=32, n_layer=2, d_state=16, headdim=8, ngroups=4)
    whole = memory_per_rank(cfg, 1)[0]["parameters"]
    assert whole == cfg.num_parameters()
    quarters = memory_per_rank(cfg, 4)
    norms = (cfg.n_layer + 1) * cfg.d_model        # replicated on every rank
    assert all(r["parameters"] == (whole - norms) // 4 + norms for r in quarters)
    fig = memory_figure({1: memory_per_rank(cfg, 1), 4: quarters}, "memory")
    assert len(fig.data) == 4 and fig.data[0].y[1] == quarters[0]["bytes"] / 2**30


def test_mamba2_needs_half_the_collectives_of_mamba1_and_attention():
    table = collectives_per_layer(d_model=1024, d_state=16)
    assert table["Mamba-2"]["forward"] == 1 and table["Mamba-1"]["forward"] == 2
    assert table["Transformer (attention + MLP)"]["backward"] == 2
    assert len(communication_figure(table, 1024).data) == 3
    assert len(curves_figure({"a": [1.0, 2.0], "b": [float("nan")]}, "t", "y").data) == 2


def test_layer_communication_sends_the_same_bytes_with_sequence_parallelism_and_splits_the_activations():
    plain = layer_communication(64, 32, 4, sequence_parallel=False)
    split = layer_communication(64, 32, 4, sequence_parallel=True)
    # a ring all-reduce is a reduce-scatter plus an all-gather: each moves (T-1)/T of the tensor per rank
    one_pass = 3 * (64 * 32 // 4) * 2
    assert plain["forward_bytes"] == split["forward_bytes"] == plain["backward_bytes"] == 2 * one_pass
    assert split["activation_bytes"] * 4 == plain["activation_bytes"] == 64 * 32 * 2
    assert allreduce_bytes(1000, 1) == 0
    with pytest.raises(ValueError, match="tp must divide them"):
        layer_communication(64, 30, 4, sequence_parallel=True)
    with pytest.raises(ValueError, match="tp must be a positive int"):
        allreduce_bytes(10, 0)


def test_tp_cost_figure_adds_state_and_activations_per_rank():
    state = {1: 2**30, 2: 2**29}
    fig = tp_cost_figure(state, d_model=64, n_layer=2, batch=1, seqlen=32, tp=2, sequence_parallel=True)
    held = [bar for bar in fig.data if bar.x[0] == "per rank"]
    assert held[0].y[0] == 0.5 and held[1].y[0] == 2 * (32 * 64 * 2 // 2) / 2**30
    assert fig.layout.title.text and fig.layout.yaxis.title.text and fig.layout.yaxis2.title.text
    with pytest.raises(ValueError, match="tp = 4 has no training-state entry"):
        tp_cost_figure(state, d_model=64, n_layer=2, batch=1, seqlen=32, tp=4, sequence_parallel=False)
