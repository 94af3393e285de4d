"""mambalab.viz.parallel_plots and mambalab.parallel.cost: the figures draw what the layers hold and cost."""
import mambalab  # noqa: F401
from mambalab.modules.lm import LMConfig
from mambalab.parallel.cost import collectives_per_layer, memory_per_rank
from mambalab.viz.parallel_plots import communication_figure, curves_figure, memory_figure, split_figure


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
