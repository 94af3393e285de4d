"""Training a (tensor-parallel) Mamba-2 language model on synthetic tasks; ``python -m mambalab.train``.

* :mod:`~mambalab.train.tasks`: selective copying and multi-query associative recall, generated from a seed.
* :mod:`~mambalab.train.trainer`: :class:`TrainConfig` and :func:`train`, the loop.
* :mod:`~mambalab.train.faults`: the fault-injection hook, the watchdog, the line a rank prints when a peer fails.
* :mod:`~mambalab.train.checkpoint`: sharded checkpoints, save and exact resume.
* :mod:`~mambalab.train.cli`: the command line (also ``mambalab train``).
"""
from mambalab.train.tasks import TASKS, make_batch
from mambalab.train.trainer import TrainConfig, train

__all__ = ["TASKS", "TrainConfig", "make_batch", "train"]
