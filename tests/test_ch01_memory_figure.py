"""The memory figure of chapter 01 keeps both curves visible when the slider's Δ equals a fixed one: the slider's
curve is dashed and narrower, drawn over the fixed curve of the same Δ."""
import math

import pytest

from mambalab.viz.scan_plots import memory_kernel_figure


def test_slider_curve_on_a_reference_delta_leaves_the_reference_visible():
    fig = memory_kernel_figure([0.03, 0.1, 0.3], -1.0, 20, highlight=0.1)
    reference = next(t for t in fig.data if t.name.startswith("Δ = 0.1 "))
    slider = fig.data[-1]
    assert slider.name.startswith("slider")
    assert list(slider.y) == list(reference.y)                  # the same curve: this is the case that hid one
    assert slider.line.dash not in (None, "solid") and reference.line.dash in (None, "solid")
    assert slider.line.width < reference.line.width             # the reference's colour shows beside the dashes
    assert fig.data.index(slider) > fig.data.index(reference)   # drawn on top
    assert reference.y[5] == pytest.approx(math.exp(-0.1 * 5))
    assert fig.layout.title.text and fig.layout.xaxis.title.text and fig.layout.yaxis.title.text


def test_memory_figure_refuses_a_non_negative_A():
    with pytest.raises(ValueError, match="A must be negative"):
        memory_kernel_figure([0.1], 0.5, 10)
