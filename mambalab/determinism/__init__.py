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

The experiments of chapters 04 and 05, one topic a module (their public names are exported here too):

    float_sums        float_bits, ordered_sum, order_spread: float addition is not associative
    atomics           atomic_sum, AtomicSumRun, fold_in_order: an atomic-add sum and its programs' landing order
                      (the kernel: :mod:`mambalab.kernels.atomic_sum`)
    ssd_variation     ssd_inputs, ssd_gradients, gradient_variation, fingerprint_matrix, time_ssd_fwd_bwd,
                      variation_in_subprocess: which SSD gradients vary between runs, batches and GPUs
    mamba_ssm_splits  mamba_ssm_head_split, mamba_ssm_norm_split: mamba-ssm's SM-count-derived groupings
    norms             norm_inputs, norm_gradients: one RMS-norm forward+backward, mamba-ssm's or mambalab's
    two_machines      train_losses, TrainRun: a tiny model trained twice, compared step by step

mambalab's kernels read neither the SM count nor an autotuner: their deterministic backward
(``reduction="deterministic"``, the default) gives the same bits on every run, launch, batch composition
and emulated GPU; ``tests/test_determinism*.py`` check it.
"""
from mambalab.determinism.arch import ARCH_PROFILES, ArchProfile, current_profile, emulate, get_profile
from mambalab.determinism.fingerprint import fingerprint
from mambalab.determinism.schedule import program_order_log, shuffled_program_order
from mambalab.determinism.switch import (REDUCTIONS, Settings, deterministic, is_deterministic, resolve_reduction,
                                         set_deterministic)
from mambalab.determinism.atomics import AtomicSumRun, atomic_sum, fold_in_order
from mambalab.determinism.float_sums import float_bits, order_spread, ordered_sum
from mambalab.determinism.mamba_ssm_splits import mamba_ssm_head_split, mamba_ssm_norm_split
from mambalab.determinism.norms import norm_gradients, norm_inputs
from mambalab.determinism.ssd_variation import (PER_ROW_GRADS, SSD_GRAD_NAMES, SUMMED_GRADS, GradientVariation,
                                                batch_with_row0, fingerprint_matrix, gradient_variation,
                                                ssd_gradients, ssd_inputs, time_ssd_fwd_bwd, variation_in_subprocess)
from mambalab.determinism.two_machines import TrainRun, train_losses

__all__ = ["ARCH_PROFILES", "REDUCTIONS", "ArchProfile", "Settings", "current_profile", "deterministic", "emulate",
           "fingerprint", "get_profile", "is_deterministic", "program_order_log", "resolve_reduction",
           "set_deterministic", "shuffled_program_order",
           # the chapters' experiments
           "PER_ROW_GRADS", "SSD_GRAD_NAMES", "SUMMED_GRADS", "AtomicSumRun", "GradientVariation", "TrainRun",
           "atomic_sum", "batch_with_row0", "fingerprint_matrix", "float_bits", "fold_in_order",
           "gradient_variation", "mamba_ssm_head_split", "mamba_ssm_norm_split", "norm_gradients", "norm_inputs",
           "order_spread", "ordered_sum", "ssd_gradients", "ssd_inputs", "time_ssd_fwd_bwd", "train_losses",
           "variation_in_subprocess"]
