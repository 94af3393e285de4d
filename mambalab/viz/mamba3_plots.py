"""Figures for the Mamba-3 chapter (notebook 03): discretisation error against Δ, parity training curves,
and what one MIMO decode step costs against a GPU's ridge point.

Every builder returns a ``plotly.graph_objects.Figure`` with a title, labelled axes and units; notebooks call
``fig.show()``. :func:`discretization_explorer` wraps :func:`discretization_figure` in ipywidgets controls (Δ and
λ). :func:`decode_step_cost` is the cost model the roofline figure draws.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from mambalab.ref import discretization

__all__ = ["H200_BF16_FLOPS", "H200_BYTES_PER_S", "H200_FP32_FLOPS", "decode_step_cost", "decode_time_figure",
           "discretization_explorer", "discretization_figure", "roofline_figure", "training_figure"]

_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
METHOD_LABELS = {"euler": "Euler", "zoh": "ZOH, x_{k-1} held", "exp_euler": "exponential-Euler (Mamba-1/2)",
                 "exp_trapezoidal": "exponential-trapezoidal (Mamba-3)"}
# NVIDIA H200 SXM datasheet: bf16 tensor cores 1,979 TFLOP/s with 2:4 sparsity, so about 989 dense; HBM3e
# 4.8 TB/s. Ridge point 989 / 4.8 ≈ 206 FLOP/byte. The same datasheet's FP32 (the ordinary CUDA cores, where a
# decode step's elementwise sums run): 67 TFLOP/s, ridge point 67 / 4.8 ≈ 14 FLOP/byte.
H200_BF16_FLOPS = 989e12
H200_FP32_FLOPS = 67e12
H200_BYTES_PER_S = 4.8e12


def discretization_figure(dt: float, dts: Sequence[float], errors: Mapping[str, Sequence[float]], *,
                          a: float = -1.0, b: float = 1.0, omega: float = 2.0, t_end: float = 10.0,
                          lam: float = 0.5) -> go.Figure:
    """Left: h(t) of h' = a h + b cos(ω t) and each method's samples at step ``dt``. Right: each method's
    maximum error over [0, t_end] against Δ (log–log, ``errors`` from :func:`mambalab.ref.discretization.error_curve`
    at the Δ values ``dts``), with a vertical line at ``dt`` and dashed ∝ Δ and ∝ Δ² guides."""
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1,
                        subplot_titles=(f"trajectories at Δ = {dt:.3g}", "maximum error over [0, T] against Δ"))
    t_fine = [t_end * i / 400 for i in range(401)]
    fig.add_trace(go.Scatter(x=t_fine, y=discretization.exact_solution(t_fine, a, b, omega).tolist(), mode="lines",
                             name="exact h(t)", line=dict(color="black", width=2)), row=1, col=1)
    for i, method in enumerate(errors):
        color = _COLORS[i % len(_COLORS)]
        t, h = discretization.simulate(method, a, b, omega, dt, t_end, lam)
        label = METHOD_LABELS.get(method, method)
        fig.add_trace(go.Scatter(x=t.tolist(), y=h.tolist(), mode="markers+lines", name=label, legendgroup=method,
                                 line=dict(color=color, width=1), marker=dict(size=4)), row=1, col=1)
        fig.add_trace(go.Scatter(x=list(dts), y=list(errors[method]), mode="lines+markers", name=label,
                                 legendgroup=method, showlegend=False, line=dict(color=color)), row=1, col=2)
    lo, hi = min(dts), max(dts)
    e0 = min(min(v) for v in errors.values())
    for power, dash in ((1, "dash"), (2, "dot")):
        fig.add_trace(go.Scatter(x=[lo, hi], y=[e0 * 10, e0 * 10 * (hi / lo) ** power], mode="lines",
                                 name=f"∝ Δ{'²' if power == 2 else ''} (slope {power})",
                                 line=dict(color="grey", dash=dash, width=1)), row=1, col=2)
    fig.add_vline(x=dt, line=dict(color="black", dash="dot", width=1), row=1, col=2)
    fig.update_xaxes(title_text="time t (s)", row=1, col=1)
    fig.update_yaxes(title_text="state h (arbitrary units)", row=1, col=1)
    fig.update_xaxes(title_text="step Δ (s)", type="log", row=1, col=2)
    fig.update_yaxes(title_text="max |h_k − h(kΔ)| (state units)", type="log", row=1, col=2)
    fig.update_layout(title=f"Discretising h' = a h + b cos(ωt): a = {a:g}, b = {b:g}, ω = {omega:g}, "
                            f"λ = {lam:g} for exponential-trapezoidal",
                      template="plotly_white", height=460, legend=dict(orientation="h", y=-0.2))
    return fig


def discretization_explorer(dts: Sequence[float], dt: float = 0.3, lam: float = 0.5, *, a: float = -1.0,
                            b: float = 1.0, omega: float = 2.0, t_end: float = 10.0):
    """Display a Δ slider and a λ slider and, below, :func:`discretization_figure` for them.

    The error curves are computed once per λ (only exponential-trapezoidal depends on it); moving Δ
    redraws the trajectories. Starts at the given values, so a headless run shows a meaningful figure.
    Displays; returns the controls as a dict.
    """
    import math

    import ipywidgets as widgets
    from mambalab.viz.notebook import explore

    style = dict(description_width="initial")
    controls = {
        "dt": widgets.FloatLogSlider(value=dt, base=10, min=math.log10(min(dts)), max=math.log10(max(dts)),
                                     step=0.05, continuous_update=False, description="step Δ (s)",
                                     readout_format=".3g", style=style),
        "lam": widgets.FloatSlider(value=lam, min=0.0, max=1.0, step=0.05, continuous_update=False,
                                   description="λ (trapezoid weight)", style=style),
    }
    fixed = [m for m in discretization.METHODS if m != "exp_trapezoidal"]  # the rules that ignore λ
    first_order = discretization.error_curve(dts, a, b, omega, t_end, methods=fixed)
    trapezoid = {}

    def errors_for(lam_value):
        if lam_value not in trapezoid:
            trapezoid[lam_value] = discretization.error_curve(dts, a, b, omega, t_end, lam_value,
                                                              methods=["exp_trapezoidal"])
        return {**first_order, **trapezoid[lam_value]}

    def figure():
        values = {k: w.value for k, w in controls.items()}
        return discretization_figure(values["dt"], dts, errors_for(values["lam"]), a=a, b=b, omega=omega,
                                     t_end=t_end, lam=values["lam"])

    return explore(controls, figure)


def training_figure(histories: Mapping[str, Mapping[str, Sequence[float]]], *, title: str | None = None,
                    chance: float | None = 0.5) -> go.Figure:
    """Loss (left) and accuracy (right) against training step, one line per model.

    ``histories`` maps a model's name to {"step": [...], "loss": [...], "accuracy": [...]}; ``chance`` draws the
    accuracy of guessing as a dashed line.
    """
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1, subplot_titles=("training loss", "accuracy"))
    for i, (name, h) in enumerate(histories.items()):
        color = _COLORS[i % len(_COLORS)]
        for col, key in ((1, "loss"), (2, "accuracy")):
            fig.add_trace(go.Scatter(x=list(h["step"]), y=list(h[key]), mode="lines", name=name, legendgroup=name,
                                     showlegend=col == 1, line=dict(color=color)), row=1, col=col)
    if chance is not None:
        fig.add_hline(y=chance, line=dict(color="grey", dash="dash", width=1), row=1, col=2,
                      annotation_text="chance", annotation_position="bottom right")
    fig.update_xaxes(title_text="training step", row=1, col=1)
    fig.update_xaxes(title_text="training step", row=1, col=2)
    fig.update_yaxes(title_text="cross-entropy (nats per token)", row=1, col=1)
    fig.update_yaxes(title_text="fraction of positions correct", range=[0, 1.02], row=1, col=2)
    fig.update_layout(title=title or "Running parity: training curves", template="plotly_white", height=420)
    return fig


def decode_step_cost(rank: int, headdim: int, d_state: int, *, state_bytes: int = 4,
                     act_bytes: int = 2) -> tuple[float, float]:
    """(FLOPs, bytes) of one decode step of one head of Mamba-3 with MIMO rank r (r = 1: SISO). A model.

    FLOPs, with p = headdim and n = d_state: the decay α h (p n), the two rank-r updates of the
    exponential-trapezoidal rule, previous and current token (2 · 2 r p n: a multiply and an add each), and
    the r outputs h q_r (2 r p n); the O(r p) gating and up/down projections are counted too (8 r p).
    Bytes: the state read and written (2 p n · ``state_bytes``, fp32 by default), plus this token's q_r, k_r
    (2 r n), x, z, y (3 p), and the previous k and v read and the new ones written (2 (r n + p)), each
    ``act_bytes``. The MIMO weights (3 r p per head) are left out: a batch of sequences shares them.
    """
    if rank < 1 or headdim < 1 or d_state < 1:
        raise ValueError(f"rank, headdim and d_state must be positive; got {rank}, {headdim}, {d_state}")
    p, n, r = headdim, d_state, rank
    flops = p * n * (1 + 6 * r) + 8 * r * p
    nbytes = 2 * p * n * state_bytes + act_bytes * (2 * r * n + 3 * p + 2 * (r * n + p))
    return float(flops), float(nbytes)


def roofline_figure(ranks: Sequence[int], headdim: int, d_state: int, *, peak_flops: float = H200_BF16_FLOPS,
                    bandwidth: float = H200_BYTES_PER_S, state_bytes: int = 4, act_bytes: int = 2,
                    device_name: str = "H200", fp32_flops: float | None = H200_FP32_FLOPS) -> go.Figure:
    """Arithmetic intensity (FLOPs per byte, :func:`decode_step_cost`) of one decode step against MIMO rank r,
    with two ridge points: the tensor cores' (``peak_flops`` / bandwidth, bf16 matrix products) and the ordinary
    fp32 units' (``fp32_flops`` / bandwidth; None leaves it out), which is where a decode step's elementwise
    arithmetic runs. Below a ridge point a step is bound by memory, so its time is set by the bytes moved, which
    r barely changes; near the fp32 one the arithmetic starts to cost time."""
    costs = [decode_step_cost(r, headdim, d_state, state_bytes=state_bytes, act_bytes=act_bytes) for r in ranks]
    intensity = [f / b for f, b in costs]
    ridge = peak_flops / bandwidth
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=list(ranks), y=intensity, mode="lines+markers+text", name="one decode step",
                             text=[f"{i:.2g}" for i in intensity], textposition="top center",
                             line=dict(color=_COLORS[0])))
    fig.add_trace(go.Scatter(x=[min(ranks), max(ranks)], y=[ridge, ridge], mode="lines",
                             name=f"{device_name} bf16 tensor-core ridge point: {peak_flops / 1e12:.0f} TFLOP/s ÷ "
                                  f"{bandwidth / 1e12:.1f} TB/s = {ridge:.0f} FLOP/byte",
                             line=dict(color=_COLORS[3], dash="dash")))
    if fp32_flops is not None:
        fp32_ridge = fp32_flops / bandwidth
        fig.add_trace(go.Scatter(x=[min(ranks), max(ranks)], y=[fp32_ridge, fp32_ridge], mode="lines",
                                 name=f"{device_name} fp32 ridge point (the step's arithmetic): "
                                      f"{fp32_flops / 1e12:.0f} TFLOP/s ÷ {bandwidth / 1e12:.1f} TB/s = "
                                      f"{fp32_ridge:.0f} FLOP/byte",
                                 line=dict(color=_COLORS[1], dash="dot")))
    fig.update_layout(
        title=f"Decode step of one head (p = {headdim}, n = {d_state}, state in {8 * state_bytes}-bit): "
              "FLOPs per byte against MIMO rank",
        xaxis=dict(title="MIMO rank r (1 = SISO)", tickvals=list(ranks)),
        yaxis=dict(title="arithmetic intensity (FLOP / byte)", type="log"),
        template="plotly_white", height=420, legend=dict(orientation="h", y=-0.25))
    return fig


def decode_time_figure(times_us: Mapping[str, float], *, note: str | None = None) -> go.Figure:
    """Bar chart of measured decode-step times (µs), one bar per configuration name."""
    names = list(times_us)
    fig = go.Figure(go.Bar(x=names, y=[times_us[k] for k in names], text=[f"{times_us[k]:.1f} µs" for k in names],
                           textposition="outside", marker_color=_COLORS[0]))
    title = "Measured time of one decode step"
    if note:
        title += f"<br><sup>{note}</sup>"
    fig.update_layout(title=title, xaxis=dict(title="configuration"),
                      yaxis=dict(title="time per step (µs)", rangemode="tozero"), template="plotly_white",
                      height=400)
    return fig


def scan_weights_figure(weights, rank: int, *, title: str | None = None) -> go.Figure:
    """Heatmap of one head's scan weights (:func:`mambalab.ref.mamba3.scan_weights`, (l·r, l·r)): rows are
    output positions, columns input positions, both (step, rank); lines mark the steps, so each step's own
    block (every pair of its ranks, weight γ_t) shows as a square on the diagonal."""
    w = weights.detach().double().cpu()
    positions = w.shape[0]
    labels = [f"t{j // rank}" + (f"·r{j % rank}" if rank > 1 else "") for j in range(positions)]
    fig = go.Figure(go.Heatmap(z=w.numpy(), x=labels, y=labels, colorscale="Blues", colorbar=dict(title="W")))
    for edge in range(rank, positions, rank):
        for line in (dict(x0=edge - 0.5, x1=edge - 0.5, y0=-0.5, y1=positions - 0.5),
                     dict(x0=-0.5, x1=positions - 0.5, y0=edge - 0.5, y1=edge - 0.5)):
            fig.add_shape(type="line", line=dict(color="rgba(0,0,0,0.25)", width=1), **line)
    fig.update_layout(title=title or f"Scan weights W[j, i], MIMO rank {rank}: earlier steps decay, a step's own "
                                     "ranks share γ_t",
                      xaxis=dict(title="input position i (step, rank)"),
                      yaxis=dict(title="output position j (step, rank)", autorange="reversed"),
                      template="plotly_white", height=460, width=560)
    return fig
