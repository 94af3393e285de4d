"""The kernel-tiles figure of chapter 01 draws one rectangle a program of the grid (b, ceil(d / block_d)), one a
block of l on each of its three lanes, and one marker a saved state; bad sizes are refused, naming the argument."""
import math

import pytest

from mambalab.viz.scan_plots import kernel_tiles_figure


@pytest.mark.parametrize("b, d, l, block_d, block_l, ckpt_l", [(2, 8, 2048, 1, 512, 128), (3, 10, 100, 4, 64, 16)])
def test_figure_draws_the_grid_the_blocks_and_the_checkpoints(b, d, l, block_d, block_l, ckpt_l):
    fig = kernel_tiles_figure(b, d, l, 16, block_d, block_l, ckpt_l, program=(b - 1, 0))
    assert fig.layout.title.text and fig.layout.xaxis.title.text == "channel (d)"
    assert fig.layout.yaxis.title.text == "batch row (b)"
    assert fig.layout.xaxis2.title.text.startswith("time step")
    programs = [s for s in fig.layout.shapes if s.xref == "x"]
    blocks = [s for s in fig.layout.shapes if s.xref == "x2"]
    assert len(programs) == b * math.ceil(d / block_d)
    assert len(blocks) == 3 * math.ceil(l / block_l)
    # the programs tile the (b, d) plane exactly: their areas add up to b·d
    assert sum((s.x1 - s.x0) * (s.y1 - s.y0) for s in programs) == b * d
    states = next(t for t in fig.data if t.name and t.name.startswith("state"))
    assert len(states.x) == math.ceil(l / ckpt_l) and states.x[-1] == l
    labels = next(t for t in fig.data if t.mode == "text").text
    assert f"({b - 1}, 0)" in labels


def test_figure_refuses_a_program_outside_the_grid_and_empty_sizes():
    with pytest.raises(ValueError, match="program"):
        kernel_tiles_figure(2, 8, 64, 4, 4, 32, 16, program=(0, 2))
    with pytest.raises(ValueError, match="block_l"):
        kernel_tiles_figure(2, 8, 64, 4, 4, 0, 16)
