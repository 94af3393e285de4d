"""One fixed training step of a model from mamba-ssm or transformers, as a user's script builds it, run with or
without :func:`mambalab.compat.use_mambalab_kernels`; its gradients fingerprinted and kept.

The models (:data:`MODELS`), each with its library's defaults (mamba-ssm's ``use_mem_eff_path=True``,
``fused_add_norm=True``, ``rms_norm=True``, ``residual_in_fp32=True``), at one of two sizes (:data:`SIZES`: ``cpu``
small enough for Triton's interpreter, ``gpu`` a few layers of realistic widths):

* ``mamba_ssm.Mamba2``, ``mamba_ssm.Mamba``: one block; loss = mean((block(u) - target)²);
* ``mamba_ssm.MambaLMHeadModel`` (Mamba-2 layers), ``transformers.Mamba2ForCausalLM``: a language model;
  loss = cross-entropy of the next token on random ids. transformers' model twice: with its config's default
  ``use_cache=True``, which builds a cache in training too, so its mixers call ``causal_conv1d_fn`` and
  ``mamba2_chunk_scan`` and its own PyTorch gated norm; and with ``use_cache=False`` (what a script that turns the
  cache off for training runs), where they call the fused ``mamba2_split_conv1d_scan_combined`` (routed: mambalab's;
  not routed: mamba-ssm's on a GPU, while on a CPU transformers' wrapper returns None and the mixer takes the
  unfused path).

Parameters, inputs and targets are drawn on the CPU from the seed and moved to the device, so every machine
starts from the same bits. :func:`run` returns a report (fingerprints of every gradient, of all of them in
order, of the output, the loss; the machine, the versions, the settings) and the tensors for
:func:`mambalab.determinism.step.save_step`, so ``mambalab fingerprint --model … --save`` files from two GPUs
compare with ``mambalab fingerprint --compare``.

Routed (``routed=True``): the step runs inside ``use_mambalab_kernels()``, which also switches on
:func:`mambalab.determinism.deterministic`. Not routed: the library's own kernels, with the determinism settings
as the process has them (mamba-ssm reads ``MAMBA_DETERMINISTIC`` when it is imported).
"""
from __future__ import annotations

import contextlib

import torch

from mambalab import device
from mambalab.determinism.arch import emulate, get_profile
from mambalab.determinism.fingerprint import fingerprint
from mambalab.determinism.switch import Settings

__all__ = ["MODELS", "SIZES", "build", "run"]

MODELS = ("mamba_ssm.Mamba2", "mamba_ssm.Mamba", "mamba_ssm.MambaLMHeadModel", "transformers.Mamba2ForCausalLM",
          "transformers.Mamba2ForCausalLM(use_cache=False)")

#: The two sizes a step runs at (fingerprints compare only at one size).
SIZES = {
    "cpu": dict(batch=2, seqlen=64, d_model=32, d_state=16, headdim=16, chunk_size=16, n_layer=2, vocab_size=64),
    "gpu": dict(batch=4, seqlen=1024, d_model=256, d_state=64, headdim=64, chunk_size=64, n_layer=4, vocab_size=1024),
}

#: Mamba-1's scan backward is the slowest op under Triton's interpreter; its CPU block is smaller.
_CPU_MAMBA1 = dict(seqlen=16, d_model=16)


def _check(model: str, size: str) -> dict:
    if model not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}; got {model!r}")
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}; got {size!r}")
    if model == "mamba_ssm.Mamba" and size == "cpu":
        return dict(SIZES[size], **_CPU_MAMBA1)
    return SIZES[size]


def build(model: str, size: str = "cpu", seed: int = 0, dev: torch.device | str | None = None) -> torch.nn.Module:
    """The model ``model`` at ``size``, initialised from ``seed`` by its library's own initialisation (drawn on
    the CPU), on ``dev`` (default: :data:`mambalab.device.DEVICE`), in training mode, fp32."""
    s = _check(model, size)
    torch.manual_seed(seed)
    if model.startswith("mamba_ssm."):
        from mambalab import oracle

        oracle.load()
    if model == "mamba_ssm.Mamba2":
        from mamba_ssm.modules.mamba2 import Mamba2

        net = Mamba2(s["d_model"], d_state=s["d_state"], headdim=s["headdim"], chunk_size=s["chunk_size"])
    elif model == "mamba_ssm.Mamba":
        from mamba_ssm.modules.mamba_simple import Mamba

        net = Mamba(s["d_model"], d_state=s["d_state"])
    elif model == "mamba_ssm.MambaLMHeadModel":
        from mamba_ssm.models.config_mamba import MambaConfig
        from mamba_ssm.models.mixer_seq_simple import MambaLMHeadModel

        config = MambaConfig(d_model=s["d_model"], n_layer=s["n_layer"], vocab_size=s["vocab_size"],
                             ssm_cfg=dict(layer="Mamba2", d_state=s["d_state"], headdim=s["headdim"],
                                          chunk_size=s["chunk_size"]), pad_vocab_size_multiple=8)
        net = MambaLMHeadModel(config)
    else:
        from transformers import Mamba2Config, Mamba2ForCausalLM

        config = Mamba2Config(hidden_size=s["d_model"], num_hidden_layers=s["n_layer"], vocab_size=s["vocab_size"],
                              state_size=s["d_state"], head_dim=s["headdim"], num_heads=2 * s["d_model"] // s["headdim"],
                              n_groups=1, expand=2, chunk_size=s["chunk_size"],
                              use_cache=not model.endswith("(use_cache=False)"))
        net = Mamba2ForCausalLM(config)
    return net.to(dev or device.DEVICE).train()


def _loss(model: str, net: torch.nn.Module, s: dict, seed: int, batch: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, output) of one forward on inputs drawn from ``seed`` (the first ``batch`` rows of the size's)."""
    gen = torch.Generator().manual_seed(seed + 1)
    if model in ("mamba_ssm.Mamba2", "mamba_ssm.Mamba"):
        u = torch.randn(s["batch"], s["seqlen"], s["d_model"], generator=gen)[:batch].to(dev)
        target = torch.randn(s["batch"], s["seqlen"], s["d_model"], generator=gen)[:batch].to(dev)
        out = net(u)
        return (out - target).square().mean(), out
    ids = torch.randint(0, s["vocab_size"], (s["batch"], s["seqlen"] + 1), generator=gen)[:batch].to(dev)
    logits = net(ids[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
    return loss, logits


def run(model: str, *, routed: bool = True, size: str = "cpu", seed: int = 0, batch: int | None = None,
        emulate_profile: str | None = None, return_tensors: bool = False):
    """One training step of ``model`` (module docstring); returns its report, and with ``return_tensors`` also
    ``{"grad/NAME": …, "output": …}`` on the CPU.

    routed: inside :func:`mambalab.compat.use_mambalab_kernels` (undone afterwards), or the library's own kernels.
    batch: use the first ``batch`` rows of the size's inputs (default: all of them).
    emulate_profile: a key of :data:`mambalab.determinism.ARCH_PROFILES`: run under ``emulate()`` (the SM count
        and autotuner picks that launchers read; mamba-ssm's launchers read them, mambalab's do not).
    ValueError naming the argument for a bad one, before anything runs.
    """
    s = _check(model, size)
    batch = s["batch"] if batch is None else batch
    if isinstance(batch, bool) or not isinstance(batch, int) or not 1 <= batch <= s["batch"]:
        raise ValueError(f"batch must be an int from 1 to {s['batch']}; got {batch!r}")
    profile = get_profile(emulate_profile) if emulate_profile is not None else None
    from mambalab.compat import use_mambalab_kernels
    from mambalab.determinism.step import environment

    dev = device.DEVICE
    with contextlib.ExitStack() as stack:
        if routed:
            stack.enter_context(use_mambalab_kernels())
        if profile is not None:
            stack.enter_context(emulate(profile))
        settings = Settings.capture().as_dict()
        net = build(model, size, seed, dev)
        loss, out = _loss(model, net, s, seed, batch, dev)
        loss.backward()
    tensors = {f"grad/{name}": p.grad.detach().cpu().clone() for name, p in net.named_parameters()
               if p.grad is not None}
    tensors["output"] = out.detach().float().cpu().clone()
    report = {
        "model": model, "routed": routed, "size": size, "shape": dict(s, batch=batch), "seed": seed,
        "fingerprint": fingerprint(net, grads=True),
        "parameters": {name: fingerprint(p.grad) for name, p in net.named_parameters() if p.grad is not None},
        "output": fingerprint(out), "loss": loss.item(), "loss_hex": loss.item().hex(),
        "emulated": profile.describe() if profile is not None else None,
        "device": str(dev), "environment": environment(), "settings": settings,
    }
    return (report, tensors) if return_tensors else report
