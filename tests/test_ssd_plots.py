"""mambalab.viz.ssd_plots: the semiseparable matrix and its block ranks, and that the figures build with titles,
axis labels, the chunk grid and one rank annotation per off-diagonal block."""
import pytest
import torch

from mambalab.ref.ssd import ssd_quadratic
from mambalab.viz import ssd_plots


def test_semiseparable_matrix_is_the_quadratic_form():
    l, n, decay = 24, 3, 0.2
    M = ssd_plots.semiseparable_matrix(l, decay, n=n, seed=1)
    assert M.shape == (l, l) and M.dtype == torch.float64
    assert torch.equal(M.triu(1), torch.zeros(l, l))
    # Rebuild the same draws and check Y = M (Δ ⊙ X) against the reference's quadratic form.
    gen = torch.Generator().manual_seed(1)
    dt = 0.5 + torch.rand(l, generator=gen, dtype=torch.float64)
    B = torch.randn(l, n, generator=gen, dtype=torch.float64)
    C = torch.randn(l, n, generator=gen, dtype=torch.float64)
    x = torch.randn(1, l, 1, 1, dtype=torch.float64)
    y, _ = ssd_quadratic(x, dt.view(1, l, 1), torch.tensor([-decay], dtype=torch.float64),
                         B.view(1, l, 1, n), C.view(1, l, 1, n))
    torch.testing.assert_close(y.view(l), M @ (dt * x.view(l)))


def test_off_diagonal_blocks_have_rank_at_most_n():
    n, q = 2, 8
    ranks = ssd_plots.block_ranks(ssd_plots.semiseparable_matrix(32, 0.01, n=n), q)
    assert sorted(ranks) == [(i, j) for i in range(4) for j in range(i)]
    assert set(ranks.values()) == {n}  # weak decay: every block keeps its full rank n


def test_semiseparable_figure_has_grid_blocks_and_rank_annotations():
    l, q, n = 40, 16, 2  # q does not divide l: a short last chunk
    fig = ssd_plots.semiseparable_figure(ssd_plots.semiseparable_matrix(l, 0.05, n=n), q, n=n)
    c = 3
    assert "Semiseparable" in fig.layout.title.text
    assert fig.layout.xaxis.title.text and fig.layout.yaxis.title.text
    names = [s.name for s in fig.layout.shapes]
    assert names.count(ssd_plots.GRID_NAME) == 2 * (c - 1)
    assert names.count(ssd_plots.DIAGONAL_NAME) == c
    assert names.count(ssd_plots.OFF_DIAGONAL_NAME) == c * (c - 1) // 2
    texts = [a.text for a in fig.layout.annotations if a.text.startswith("rank")]
    assert texts == [f"rank {n}"] * (c * (c - 1) // 2)
    assert fig.data[0].type == "heatmap"


def test_cost_figure_has_log_axes_and_labels():
    lengths = [64, 128, 256]
    fig = ssd_plots.cost_figure(lengths, {"quadratic": [1.0, 3.0, 9.0], "chunked": [1.0, 2.0, None]},
                                {"quadratic": [2**20, 2**22, 2**24], "chunked": [2**20, 2**21, 2**22]},
                                note="CPU")
    assert "CPU" in fig.layout.title.text
    for axis in (fig.layout.xaxis, fig.layout.xaxis2, fig.layout.yaxis, fig.layout.yaxis2):
        assert axis.type == "log" and axis.title.text
    assert "(ms)" in fig.layout.yaxis.title.text and "MiB" in fig.layout.yaxis2.title.text
    with pytest.raises(ValueError, match="quadratic"):
        ssd_plots.cost_figure(lengths, {"quadratic": [1.0]}, {})
