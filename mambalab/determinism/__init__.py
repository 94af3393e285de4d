"""Determinism: why gradients differ between runs and GPUs, and the one switch that makes them repeat.

    switch       deterministic(), set_deterministic(flag), is_deterministic(), resolve_reduction(reduction):
                 every setting that decides whether bits repeat (torch, cuBLAS, cuDNN, mamba-ssm, mambalab)
    fingerprint  fingerprint(obj, grads=False): 16 hex characters, equal exactly when the bits are
    arch         ArchProfile, ARCH_PROFILES, emulate(profile), current_profile(): run as if on another GPU
                 model, as far as software can see (SM count, compute capability, autotune pick)
    autotune     the autotuner pick under the switch (pinned) and under emulate() (per profile)
    schedule     shuffled_program_order(seed): a SIMULATION, on the CPU interpreter, of the order in which a
                 GPU runs a launch's programs (what makes atomic sums vary from run to run)
    step         the fixed Mamba-2 training step behind ``mambalab fingerprint`` (run_step, format_report)

mambalab's kernels read neither the SM count nor an autotuner: their deterministic backward
(``reduction="deterministic"``, the default) gives the same bits on every run, launch, batch composition
and emulated GPU; ``tests/test_determinism*.py`` check it.
"""
from mambalab.determinism.arch import ARCH_PROFILES, ArchProfile, current_profile, emulate, get_profile
from mambalab.determinism.fingerprint import fingerprint
from mambalab.determinism.schedule import program_order_log, shuffled_program_order
from mambalab.determinism.switch import (REDUCTIONS, Settings, deterministic, is_deterministic, resolve_reduction,
                                         set_deterministic)

__all__ = ["ARCH_PROFILES", "REDUCTIONS", "ArchProfile", "Settings", "current_profile", "deterministic", "emulate",
           "fingerprint", "get_profile", "is_deterministic", "program_order_log", "resolve_reduction",
           "set_deterministic", "shuffled_program_order"]
