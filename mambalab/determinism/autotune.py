"""Which autotuned configuration a Triton kernel runs: pinned, or picked per emulated GPU.

Triton's ``Autotuner`` times every candidate configuration on the machine at hand and keeps the fastest,
per distinct value of its ``key`` arguments. Two GPUs (or two runs, when timings are close) can keep
different configurations; a different tile changes the order of a kernel's sums, and so its bits. mambalab's
own kernels have no autotuner (tiles come from a documented shape rule); mamba-ssm's have.

This module replaces that timing, while one of two things is in force:

* **pinned** (set by the determinism switch, :mod:`mambalab.determinism.switch`): every autotuned kernel
  runs the *first* configuration that survives its pruning (and, on a GPU, runs there): the same on every
  machine that can run it, no timing at all.
* **emulated** (set by :func:`mambalab.determinism.emulate`): the pick is a fixed function of the emulated
  profile's key, the kernel's name and the configuration: each profile always keeps the same
  configuration, and different profiles may keep different ones, as different GPUs do. It stands for "this
  machine's own choice"; it is *not* the configuration a real GPU of that model would pick, which depends
  on its timings (compare ``mambalab fingerprint`` on the real machines for that).

On a real GPU each candidate is still launched once, so one that cannot run there (more shared memory than
the GPU has) is dropped as Triton's own timing would drop it; the CPU interpreter launches none.
Pinned wins over emulated (that is what pinning is for). Picks made here go to a separate cache per
policy, so Triton's own cache (and its on-disk ``TRITON_CACHE_AUTOTUNING`` results) are neither read nor
changed. The patch is installed on ``triton.runtime.autotuner.Autotuner.run`` once, on first use, and only
acts while a policy is in force; if Triton's internals are not the ones expected it raises, naming them.
"""
from __future__ import annotations

import hashlib

__all__ = ["policy", "set_emulated", "set_pinned"]

_pinned = False
_emulated_key: str | None = None
_original_run = None


def set_pinned(flag: bool) -> bool:
    """Pin every autotuned kernel to its first configuration (True) or stop pinning; returns the old value."""
    global _pinned
    old, _pinned = _pinned, bool(flag)
    if _pinned:
        _install()
    return old


def set_emulated(profile_key: str | None) -> str | None:
    """Pick configurations as the profile ``profile_key`` would (None: stop); returns the old key."""
    global _emulated_key
    old, _emulated_key = _emulated_key, profile_key
    if profile_key is not None:
        _install()
    return old


def policy() -> str | None:
    """"pinned", "emulated:<key>", or None (Triton times the candidates itself)."""
    if _pinned:
        return "pinned"
    if _emulated_key is not None:
        return f"emulated:{_emulated_key}"
    return None


def _cost(name: str, config, configs) -> float:
    """The stand-in for a timing: lower wins."""
    if _pinned:
        try:
            return float(configs.index(config))
        except ValueError:  # a configuration made by the kernel's own pruning: after the listed ones
            return float(len(configs))
    digest = hashlib.blake2b(f"{_emulated_key}|{name}|{config}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64


def _real_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _install() -> None:
    global _original_run
    if _original_run is not None:
        return
    from triton.runtime import autotuner

    cls = getattr(autotuner, "Autotuner", None)
    needed = ("run", "_bench", "cache", "configs", "cache_results")
    if cls is None or not hasattr(cls, "run") or not hasattr(cls, "_bench"):
        raise RuntimeError(f"mambalab.determinism cannot pin Triton's autotuner: triton.runtime.autotuner."
                           f"Autotuner lacks one of {needed} in this Triton version")
    _original_run = cls.run

    def run(self, *args, **kwargs):
        current = policy()
        if current is None or len(self.configs) <= 1:
            return _original_run(self, *args, **kwargs)
        name = getattr(getattr(self, "base_fn", None), "__name__", repr(self.fn))
        caches = self.__dict__.setdefault("_mambalab_caches", {})
        patched = ("cache", "cache_results", "_bench", "_do_bench", "do_bench")
        saved = {k: self.__dict__[k] for k in patched if k in self.__dict__}
        self.cache = caches.setdefault(current, {})
        self.cache_results = False
        cost = lambda config: [_cost(name, config, self.configs)] * 3
        if _real_gpu():
            # Each candidate is launched once through Triton's own _bench, with the stand-in cost in place of
            # its timing: a configuration that cannot run here (OutOfResources, a failed compile) still gets
            # Triton's infinite time and loses, as it would under Triton's own timing.
            triton_bench = type(self)._bench

            def bench(*a, config, **kw):
                stand_in = lambda kernel_call, quantiles: (kernel_call(), cost(config))[1]
                # Triton 3.6 reads self.do_bench, a functools.cached_property over _do_bench: the first read
                # caches whatever _do_bench was then, so both are set (with _do_bench alone every candidate
                # would get the first one's cost, and every pick would be the first configuration)
                self._do_bench = self.__dict__["do_bench"] = stand_in
                return triton_bench(self, *a, config=config, **kw)

            self._bench = bench
        else:   # the CPU interpreter has no resource limits: no launch needed to rank the candidates
            self._bench = lambda *a, config, **kw: cost(config)
        try:
            return _original_run(self, *args, **kwargs)
        finally:
            for k in patched:
                if k in saved:
                    self.__dict__[k] = saved[k]
                else:
                    self.__dict__.pop(k, None)

    cls.run = run
