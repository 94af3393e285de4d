"""mambalab.viz.mamba3_plots: the decode-step cost model (its FLOPs and bytes, intensity growing with r and far
below an H200's ridge), and that every figure builds with a title, axis labels and its traces."""
import pytest

from mambalab.ref import discretization as dz
from mambalab.viz import mamba3_plots as mp


def test_decode_step_cost_counts_the_state_and_the_rank_r_work():
    p, n = 64, 128
    flops1, bytes1 = mp.decode_step_cost(1, p, n)
    flops4, bytes4 = mp.decode_step_cost(4, p, n)
    assert flops1 == p * n * 7 + 8 * p                       # decay + two rank-1 updates + one output
    assert bytes1 == 2 * p * n * 4 + 2 * (2 * n + 3 * p + 2 * (n + p))
    # r = 4 does about 3.5x the FLOPs while moving barely more bytes: the state dominates the traffic.
    assert flops4 / flops1 == pytest.approx(25 / 7, rel=0.01)
    assert bytes4 / bytes1 < 1.1
    intensities = [mp.decode_step_cost(r, p, n)[0] / mp.decode_step_cost(r, p, n)[1] for r in (1, 2, 4, 8)]
    assert intensities == sorted(intensities) and intensities[-1] < mp.H200_BF16_FLOPS / mp.H200_BYTES_PER_S
    with pytest.raises(ValueError, match="must be positive"):
        mp.decode_step_cost(0, p, n)


def test_roofline_figure_has_the_ridge_point():
    fig = mp.roofline_figure([1, 2, 4, 8], 64, 128)
    assert fig.layout.title.text and fig.layout.xaxis.title.text and fig.layout.yaxis.title.text
    assert list(fig.data[0].x) == [1, 2, 4, 8]
    # the H200's dense bf16 peak (989 TFLOP/s) over its HBM bandwidth (4.8 TB/s): about 206 FLOP/byte
    assert fig.data[1].y[0] == pytest.approx(989e12 / 4.8e12) and fig.data[1].y[0] == pytest.approx(206, abs=0.5)
    assert "ridge" in fig.data[1].name and "989 TFLOP/s" in fig.data[1].name and "= 206 FLOP/byte" in fig.data[1].name


def test_discretization_figure_has_trajectories_and_error_curves():
    dts = [0.5, 0.25, 0.125]
    errors = dz.error_curve(dts, t_end=2.0)
    fig = mp.discretization_figure(0.25, dts, errors, t_end=2.0)
    assert "Discretising" in fig.layout.title.text
    names = [d.name for d in fig.data]
    assert names[0] == "exact h(t)" and sum("trapezoidal" in (n or "") for n in names) == 2
    assert fig.layout.xaxis2.type == "log" and fig.layout.yaxis2.type == "log"
    assert fig.layout.xaxis.title.text and fig.layout.yaxis2.title.text


def test_training_and_decode_time_figures():
    hist = {"rotary": {"step": [0, 1], "loss": [0.7, 0.1], "accuracy": [0.5, 0.9]},
            "real": {"step": [0, 1], "loss": [0.7, 0.69], "accuracy": [0.5, 0.52]}}
    fig = mp.training_figure(hist)
    assert len([d for d in fig.data if d.showlegend is not False]) == 2 and fig.layout.yaxis2.title.text
    bars = mp.decode_time_figure({"r = 1": 10.0, "r = 4": 11.0})
    assert list(bars.data[0].y) == [10.0, 11.0] and bars.layout.yaxis.title.text


def test_discretization_explorer_redraws_when_a_slider_moves(monkeypatch):
    from mambalab.viz.notebook import LiveFigure

    shown = []   # every figure bundle the explorer's LiveFigure was given, in order
    original = LiveFigure._set

    def recording(self, bundle):
        shown.append(bundle)
        original(self, bundle)

    monkeypatch.setattr(LiveFigure, "_set", recording)
    monkeypatch.setattr("IPython.display.display", lambda *args, **kwargs: None)
    controls = mp.discretization_explorer([0.5, 0.25, 0.125], dt=0.25, t_end=2.0)
    controls["lam"].value = 1.0
    controls["dt"].value = 0.5
    titles = [b["application/vnd.plotly.v1+json"]["layout"]["title"]["text"] for b in shown]
    assert len(titles) == 3 and "λ = 0.5" in titles[0] and "λ = 1" in titles[1]
    subtitles = [b["application/vnd.plotly.v1+json"]["layout"]["annotations"][0]["text"] for b in shown]
    assert subtitles[1] == "trajectories at Δ = 0.25" and subtitles[2] == "trajectories at Δ = 0.5"
    assert "text/html" in shown[-1]
