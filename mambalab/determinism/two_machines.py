"""Two machines train the same model: where their losses part, and after which step their weights' bits do.

:func:`train_losses` trains a tiny :class:`mambalab.modules.Mamba2` regressor from a fixed seed and returns its
loss and the parameters' fingerprint per step (:class:`TrainRun`), optionally under ``emulate(profile)`` and, on
the CPU interpreter, under a seeded program-order *simulation* of a GPU's scheduling
(:func:`mambalab.determinism.shuffled_program_order`), labelled so wherever it is used.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

__all__ = ["TrainRun", "train_losses"]


@contextlib.contextmanager
def _mamba_ssm_scan():
    """Inside, :class:`mambalab.modules.Mamba2` calls mamba-ssm's ``mamba_chunk_scan_combined`` instead of
    mambalab's SSD (same arguments; mamba-ssm takes no ``reduction``). GPU only."""
    from mambalab import oracle
    from mambalab.modules import mamba2 as m2

    rival = oracle.module("ops.triton.ssd_combined").mamba_chunk_scan_combined
    own = m2.ssd_chunk_scan

    def scan(*args, reduction=None, **kw):
        return rival(*args, **kw)

    m2.ssd_chunk_scan = scan
    try:
        yield
    finally:
        m2.ssd_chunk_scan = own


class _Regressor(torch.nn.Module):
    """Linear in, one Mamba2 block, linear out: (b, l, d_in) -> (b, l, d_in)."""

    def __init__(self, d_in: int, d_model: int, **mamba_kw):
        super().__init__()
        from mambalab.modules import Mamba2

        self.inp = torch.nn.Linear(d_in, d_model)
        self.mixer = Mamba2(d_model, **mamba_kw)
        self.out = torch.nn.Linear(d_model, d_in)

    def forward(self, u):
        return self.out(self.mixer(self.inp(u)))


@dataclass(frozen=True)
class TrainRun:
    """What :func:`train_losses` records per step: the loss, and the parameters' fingerprint after the step."""

    losses: list[float]
    fingerprints: list[str]

    def first_divergence(self, other: "TrainRun") -> int | None:
        """The first step after which the parameters' bits differ from ``other``'s, or None if never."""
        return next((k for k, (a, b) in enumerate(zip(self.fingerprints, other.fingerprints)) if a != b), None)


def train_losses(steps: int, *, reduction: str | None = "deterministic", impl: str = "mambalab",
                 profile: str | None = None, schedule_seed: int | None = None, batch: int = 2, seqlen: int = 32,
                 d_in: int = 4, d_model: int = 16, d_state: int = 8, headdim: int = 4, ngroups: int = 1,
                 chunk_size: int = 16, lr: float = 1e-2, seed: int = 0, device: str = "cpu") -> TrainRun:
    """Train a tiny Mamba2 regressor for ``steps`` Adam steps from ``seed``; returns each step's loss and the
    fingerprint of the parameters after it (:class:`TrainRun`).

    The task: predict each input vector from three positions back (y_t = u_{t-3}; MSE), fresh random
    sequences every step, all drawn from ``seed`` so that two calls see the same data and initial weights.

    reduction: the SSD backward's ("atomic" or "deterministic"); impl "mamba_ssm" swaps in mamba-ssm's
    ``mamba_chunk_scan_combined`` (GPU only; its mode follows ``set_deterministic_mode``).
    profile: run under :func:`mambalab.determinism.emulate` of this profile (None: the real device).
    schedule_seed: CPU interpreter only, run every launch of step k in the shuffled program order seeded by
    (schedule_seed, k): a SIMULATION of how a GPU's scheduler orders atomics differently on each machine.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1; got {steps}")
    if impl not in ("mambalab", "mamba_ssm"):
        raise ValueError(f"impl must be 'mambalab' or 'mamba_ssm'; got {impl!r}")
    if schedule_seed is not None and device != "cpu":
        raise ValueError("schedule_seed simulates a GPU's scheduling on the CPU interpreter; on a GPU the "
                         "hardware orders the atomics itself (pass schedule_seed=None)")
    from mambalab import determinism

    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = _Regressor(d_in, d_model, d_state=d_state, headdim=headdim, ngroups=ngroups, chunk_size=chunk_size,
                       reduction=reduction).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    data = [torch.randn(batch, seqlen + 3, d_in, generator=gen) for _ in range(steps)]
    losses, prints = [], []
    with contextlib.ExitStack() as stack:
        if profile is not None:
            stack.enter_context(determinism.emulate(profile))
        if impl == "mamba_ssm":
            stack.enter_context(_mamba_ssm_scan())
        for k, seq in enumerate(data):
            seq = seq.to(device)
            u, y = seq[:, 3:], seq[:, :-3]
            with (determinism.shuffled_program_order(schedule_seed * 100_003 + k) if schedule_seed is not None
                  else contextlib.nullcontext()):
                loss = torch.nn.functional.mse_loss(model(u), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            prints.append(determinism.fingerprint(model))
    return TrainRun(losses, prints)
