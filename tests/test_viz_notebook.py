"""mambalab.viz.notebook: check's verdicts, show_source's text, setup outside a kernel."""
import math

import pytest
import torch

from mambalab.kernels import reduce
from mambalab.ref import selective_scan as ref_module
from mambalab.viz import notebook


def test_check_passes_within_tolerance_and_prints_one_line(capsys):
    got, expected = torch.tensor([1.0, 2.0], dtype=torch.float64), torch.tensor([1.0, 2.0 + 1e-7], dtype=torch.float64)
    assert notebook.check("close", got, expected) is None
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith("✓ close: max |Δ| = 1e-07")


def test_check_uses_atol_plus_rtol_times_expected(capsys):
    notebook.check("rtol", torch.tensor([100.0]), torch.tensor([100.5]), atol=0.0, rtol=1e-2)
    with pytest.raises(AssertionError, match=r"✗ rtol: max \|Δ\| = 0.5 .*1 of 1"):
        notebook.check("rtol", torch.tensor([100.0]), torch.tensor([100.5]), atol=0.0, rtol=1e-3)
    assert capsys.readouterr().out.splitlines()[-1].startswith("✗ rtol")


def test_check_fails_on_nan_shape_mismatch_and_names_the_worst_element():
    with pytest.raises(AssertionError, match="1 of 3"):
        notebook.check("nan", torch.tensor([0.0, math.nan, 0.0]), torch.zeros(3))
    with pytest.raises(AssertionError, match=r"shape \(2, 3\) != expected \(3, 2\)"):
        notebook.check("shape", torch.zeros(2, 3), torch.zeros(3, 2))
    got = torch.zeros(2, 3)
    got[1, 2] = 5.0
    with pytest.raises(AssertionError, match=r"worst at \(1, 2\): got 5, expected 0"):
        notebook.check("worst", got, torch.zeros(2, 3))


def test_check_accepts_numbers_and_other_dtypes():
    notebook.check("scalar", 1.0, torch.tensor(1.0))
    notebook.check("bf16", torch.ones(4, dtype=torch.bfloat16), torch.ones(4), atol=0, rtol=0)


def test_show_source_displays_the_function_with_its_location(monkeypatch):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj: shown.append(obj))
    notebook.show_source(ref_module.selective_scan_ref)
    (source,) = shown
    assert source.code.startswith("def selective_scan_ref(")
    assert source.caption.startswith("mambalab.ref.selective_scan.selective_scan_ref  (mambalab/ref/selective_scan.py:")
    html = source._repr_html_()
    assert "selective_scan_ref" in html and "<span" in html  # highlighted


def test_show_source_unwraps_triton_kernels():
    source = notebook.source_of(reduce.sum_partials_kernel)
    assert "def sum_partials_kernel(" in source.code
    assert source.code.lstrip().startswith("@triton.jit")


def test_show_source_rejects_objects_without_source():
    with pytest.raises(TypeError, match="cannot find the source"):
        notebook.source_of(len)


def test_setup_does_nothing_outside_a_kernel(capsys):
    assert notebook.setup() is None
    assert capsys.readouterr().out == ""


def test_live_figure_replaces_its_output_and_displays_a_static_stand_in(monkeypatch):
    import plotly.graph_objects as go

    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj, raw=False: shown.append(obj))
    live = notebook.LiveFigure(go.Figure(go.Scatter(y=[1, 2]), layout_title_text="first"))
    live.display()
    bundle = shown[0]
    assert bundle[notebook.WIDGET_VIEW_MIMETYPE]["model_id"] == live.output.model_id
    assert "first" in bundle["text/html"] and "Plotly.newPlot" in bundle["text/html"]
    live.update(go.Figure(go.Scatter(y=[3, 4]), layout_title_text="second"))
    (output,) = live.output.outputs
    assert output["data"][notebook.PLOTLY_MIMETYPE]["layout"]["title"]["text"] == "second"
    assert "first" in bundle["text/html"]  # the stand-in stays the first figure
