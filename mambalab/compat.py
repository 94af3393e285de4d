"""Run an existing mamba-ssm or transformers program on mambalab's kernels, by one call and without editing it.

A training script written against mamba-ssm (``Mamba``, ``Mamba2``, ``MambaLMHeadModel``) or transformers
(``MambaForCausalLM``, ``Mamba2ForCausalLM``) reaches mamba-ssm's kernels through module-level names:
``mamba_ssm.modules.mamba2`` calls ``mamba_split_conv1d_scan_combined``, its ``Block`` calls
``layer_norm_fn``, transformers' ``Mamba2Mixer`` calls ``mamba2_split_conv1d_scan_combined`` (or, with a
cache, which its config's default ``use_cache=True`` builds in training too, ``causal_conv1d_fn`` and
``mamba2_chunk_scan``), and so on. Each
module looks the name up in its own globals when it runs, so rebinding that global, in every module that
holds it (the one that defines it and the ones that imported it by name), routes the call::

    import mambalab.compat
    routing = mambalab.compat.use_mambalab_kernels()     # before or after the model is built
    print(routing.summary())                             # what was bound, what was left alone and why
    ...                                                  # train as before
    routing.undo()                                       # or: with mambalab.compat.use_mambalab_kernels(): ...

What the bound functions change: their backwards sum in an order fixed by the shape alone (mambalab's
deterministic reduction), so gradients repeat bit for bit from run to run, and no launcher reads the GPU's
SM count, which mamba-ssm's dB/dC sums and norm backwards do even in its deterministic mode. Their results
equal mamba-ssm's within floating-point rounding (the tests compare them with mamba-ssm's references).

What stays as it was: the program's own PyTorch layers (``nn.Linear``'s matmuls in cuBLAS, embeddings,
transformers' plain-PyTorch RMSNorms), whose bits cuBLAS and PyTorch choose per GPU model; mamba-ssm's Mamba-3
kernels (their layouts differ from mambalab's: left bound to mamba-ssm, listed as such); transformers' decode
steps. Without mamba-ssm installed nothing of it is bound; on a machine without its CUDA extension
(a CPU) :mod:`mambalab.oracle` makes it importable first, so the same script runs there on Triton's interpreter.
"""
from __future__ import annotations

import importlib
import importlib.util
import warnings
from dataclasses import dataclass, field
from typing import Callable

__all__ = ["Binding", "KernelRouting", "SUPPORTED_MAMBA_SSM", "use_mambalab_kernels"]

SUPPORTED_MAMBA_SSM = "2.3.2.post1"   # the version whose signatures mambalab's drop-ins follow


def _ops() -> dict[str, Callable]:
    """mambalab's drop-ins under mamba-ssm's (and causal_conv1d's) names."""
    from mambalab import ops
    from mambalab.modules import norm

    return {
        "selective_scan_fn": ops.selective_scan,
        "mamba_inner_fn": ops.mamba_inner_fn,
        "causal_conv1d_fn": ops.causal_conv1d_fn,
        "causal_conv1d_update": ops.causal_conv1d_update,
        "selective_state_update": ops.selective_state_update,
        "mamba_chunk_scan_combined": ops.ssd_chunk_scan,
        "mamba_split_conv1d_scan_combined": ops.mamba_split_conv1d_scan_combined,
        "layer_norm_fn": ops.layer_norm_fn,
        "rms_norm_fn": ops.rms_norm_fn,
        "rmsnorm_fn": norm.rmsnorm_fn,        # the gated norm's (ops/triton/layernorm_gated.py)
        "layernorm_fn": norm.layernorm_fn,
    }


# mamba-ssm's modules and the kernel names each looks up in its globals (tag v2.3.2.post1). A name a module does
# not hold is skipped; causal_conv1d's names are None there when that package is absent, and binding ours sends
# the module down its causal_conv1d path (mamba_simple's fast path, mamba2's fused conv).
MAMBA_SSM_NAMES = {
    "ops.selective_scan_interface": ("selective_scan_fn", "mamba_inner_fn", "causal_conv1d_fn"),
    "ops.triton.ssd_combined": ("mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined",
                                "causal_conv1d_fn"),
    "ops.triton.layernorm_gated": ("rmsnorm_fn", "layernorm_fn"),
    "ops.triton.layer_norm": ("layer_norm_fn", "rms_norm_fn"),
    "ops.triton.selective_state_update": ("selective_state_update",),
    "modules.mamba_simple": ("mamba_inner_fn", "selective_scan_fn", "causal_conv1d_fn", "causal_conv1d_update",
                             "selective_state_update"),
    "modules.mamba2": ("mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined", "causal_conv1d_fn",
                       "causal_conv1d_update", "selective_state_update"),
    "modules.mamba2_simple": ("mamba_chunk_scan_combined", "mamba_split_conv1d_scan_combined", "causal_conv1d_fn"),
    "modules.block": ("layer_norm_fn",),
    "models.mixer_seq_simple": ("layer_norm_fn",),
}
MAMBA_SSM_LEFT = {
    "modules.mamba3": "mamba-ssm's Mamba-3 kernels take (b, h, l, ...) layouts and raw gates that mambalab's "
                      "Mamba-3 ops do not; Mamba3 blocks keep mamba-ssm's kernels (use mambalab.modules.Mamba3)",
}


def _keyword_tolerant(fn: Callable, passes: tuple[str, ...] = ()) -> Callable:
    """``fn`` for transformers' call sites, which pass ``**kwargs`` through: the keywords in ``passes`` reach fn,
    others must be None (an unhonoured one raises TypeError naming it)."""
    import functools
    import inspect

    params = set(inspect.signature(fn).parameters)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        extra = {k: v for k, v in kwargs.items() if k not in params and k not in passes}
        unused = sorted(k for k, v in extra.items() if v is not None)
        if unused:
            raise TypeError(f"mambalab's {fn.__name__} does not take {', '.join(unused)} (called by transformers)")
        return fn(*args, **{k: v for k, v in kwargs.items() if k not in extra})

    return call


def _transformers_names() -> dict[str, dict[str, Callable]]:
    """transformers' Mamba and Mamba2 modules: their kernel wrappers' names (training path and scans; the decode
    steps, which transformers calls with (b, d, 1) blocks and its own cache, stay transformers')."""
    o = _ops()
    conv = _keyword_tolerant(o["causal_conv1d_fn"], ("seq_idx",))
    return {
        "transformers.models.mamba2.modeling_mamba2": {
            "mamba2_split_conv1d_scan_combined": _keyword_tolerant(o["mamba_split_conv1d_scan_combined"]),
            "mamba2_chunk_scan": _keyword_tolerant(o["mamba_chunk_scan_combined"]),
            "causal_conv1d_fn": conv,
        },
        "transformers.models.mamba.modeling_mamba": {
            "mamba_inner_fn": _keyword_tolerant(o["mamba_inner_fn"]),
            "mamba_selective_scan": _keyword_tolerant(o["selective_scan_fn"]),
            "causal_conv1d_fn": conv,
        },
    }


@dataclass
class Binding:
    """One rebound global: ``module.name`` was ``original`` and is ``replacement`` while the routing holds."""

    module: str
    name: str
    original: object
    replacement: object

    def describe(self) -> str:
        was = "None" if self.original is None else getattr(self.original, "__module__", "?")
        return f"{self.module}.{self.name} -> mambalab (was {was})"


@dataclass
class KernelRouting:
    """What :func:`use_mambalab_kernels` bound (``bound``) and left alone (``left``: (where, why)).
    :meth:`undo` puts every original back; as a context manager it undoes on exit."""

    bound: list[Binding] = field(default_factory=list)
    left: list[tuple[str, str]] = field(default_factory=list)
    settings_before: object = None    # the determinism settings to put back (a switch Settings), if it set them
    active: bool = True

    def undo(self) -> None:
        """Restore every name this routing bound, last first. A name someone rebound since is left as it is, with
        a warning naming it."""
        if not self.active:
            return
        for b in reversed(self.bound):
            mod = importlib.import_module(b.module)
            if getattr(mod, b.name, None) is b.replacement:
                setattr(mod, b.name, b.original)
            else:
                warnings.warn(f"{b.module}.{b.name} was rebound after mambalab bound it; left as it is", stacklevel=2)
        if self.settings_before is not None:
            self.settings_before.apply()
        self.active = False

    def __enter__(self) -> "KernelRouting":
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def summary(self) -> str:
        lines = [f"mambalab kernels bound to {len(self.bound)} names:"]
        lines += [f"  {b.describe()}" for b in self.bound]
        if self.settings_before is not None:
            lines.append("determinism switch on (mambalab.determinism.set_deterministic(True)) until undo()")
        if self.left:
            lines.append("left as they were:")
            lines += [f"  {where}: {why}" for where, why in self.left]
        return "\n".join(lines)


def _installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def _bind_all(routing: KernelRouting, plan: dict[str, dict[str, Callable]]) -> None:
    """Bind ``plan``'s names ({module: {name: replacement}}), importing every module before binding any: a module
    first imported after a name was bound would copy the replacement as its own (``mamba2_simple`` imports
    ``ssd_combined``'s functions by name), and :meth:`KernelRouting.undo` would then restore mambalab's."""
    modules = {}
    for module_name in plan:
        try:
            modules[module_name] = importlib.import_module(module_name)
        except ImportError as err:
            routing.left.append((module_name, f"not importable here ({err})"))
    for module_name, mod in modules.items():
        for name, replacement in plan[module_name].items():
            if not hasattr(mod, name):
                continue
            routing.bound.append(Binding(module_name, name, getattr(mod, name), replacement))
            setattr(mod, name, replacement)


def use_mambalab_kernels(*, mamba_ssm: bool = True, transformers: bool = True, deterministic: bool = True,
                         check_version: bool = True) -> KernelRouting:
    """Bind mamba-ssm's public kernel names (and transformers' Mamba/Mamba2 kernel wrappers) to mambalab's
    drop-ins, in every module that holds them (module docstring). Returns a :class:`KernelRouting` that lists
    what it bound and undoes it (``undo()``, or use it in a ``with``).

    mamba_ssm, transformers: which libraries to route (each only where installed; nothing is imported or bound
        for one that is absent).
    deterministic: also switch every determinism setting on (:func:`mambalab.determinism.set_deterministic`:
        mambalab's fixed-order reductions, torch's deterministic algorithms, cuBLAS's fixed workspace, TF32 off
        in torch's matmuls and cuDNN; Triton kernels choose their dot precision themselves, see
        :mod:`mambalab.determinism.switch`); ``undo()`` puts the settings in force before back.
    check_version: mamba-ssm's signatures are those of version :data:`SUPPORTED_MAMBA_SSM`; another installed
        version raises RuntimeError naming it, unless this is False.
    """
    if mamba_ssm and check_version and _installed("mamba_ssm"):
        from mambalab import oracle

        found = oracle.version()
        if found != SUPPORTED_MAMBA_SSM:
            raise RuntimeError(f"mambalab's drop-ins follow mamba-ssm {SUPPORTED_MAMBA_SSM}'s signatures; "
                               f"mamba-ssm {found} is installed (pass check_version=False to bind anyway)")
    routing = KernelRouting()
    ops = _ops()
    if mamba_ssm and _installed("mamba_ssm"):
        from mambalab import oracle

        oracle.load()   # importable on a machine without its CUDA extension too; imported before the switch
        # below sets MAMBA_DETERMINISTIC, so mamba-ssm's own import-time choices stay the process's
    if deterministic:
        from mambalab.determinism.switch import Settings, set_deterministic

        routing.settings_before = Settings.capture()
        set_deterministic(True)
    if mamba_ssm and _installed("mamba_ssm"):
        _bind_all(routing, {f"mamba_ssm.{module}": {name: ops[name] for name in names}
                            for module, names in MAMBA_SSM_NAMES.items()})
        routing.left += [(f"mamba_ssm.{m}", why) for m, why in MAMBA_SSM_LEFT.items()]
    elif mamba_ssm:
        routing.left.append(("mamba_ssm", "not installed"))
    if transformers and _installed("transformers"):
        _bind_all(routing, _transformers_names())
        routing.left.append(("transformers' decode steps and RMSNorms", "kept: plain PyTorch or per-token kernels"))
    elif transformers:
        routing.left.append(("transformers", "not installed"))
    return routing
