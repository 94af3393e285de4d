"""When a rank fails: the fault tests inject, the watchdog that notices a silent peer, and the line a rank prints.

* :func:`crash_if_asked`: fault injection for tests and demos. Rank ``fail_rank`` exits at step
  ``fail_at_step`` (exit code 17) without any cleanup, as a killed process would.
* :class:`Watchdog`: exits the process (exit code 3) if no step finishes within ``timeout_s``; it catches what a
  collective's timeout cannot, e.g. NCCL waiting on a dead peer.
* :func:`exit_on_peer_failure`: a collective that lost its peer, or timed out, becomes one line naming this
  rank and the step, and the process exits (exit code 1) instead of hanging. A single process re-raises.
"""
from __future__ import annotations

import os
import sys
import threading
import time

__all__ = ["Watchdog", "crash_if_asked", "describe", "exit_on_peer_failure"]


def describe(layout) -> str:
    """This rank, as the messages name it: "rank R (tp_rank T, dp_rank D)", with ", cp_rank K" when CP > 1."""
    cp = f", cp_rank {layout.cp_rank}" if getattr(layout, "cp", 1) > 1 else ""
    return f"rank {layout.rank} (tp_rank {layout.tp_rank}, dp_rank {layout.dp_rank}{cp})"


def crash_if_asked(cfg, layout, step: int) -> None:
    """Exit at once (code 17) if this is rank ``cfg.fail_rank`` and ``step`` is ``cfg.fail_at_step``."""
    if step == cfg.fail_at_step and layout.rank == cfg.fail_rank:
        print(f"mambalab.train: {describe(layout)}: simulated crash at step {step} (fail_at_step)",
              file=sys.stderr, flush=True)
        os._exit(17)


class Watchdog:
    """Exit the process if :meth:`beat` is not called for ``timeout_s`` seconds (armed by the first beat)."""

    def __init__(self, timeout_s: float, describe):
        self.timeout_s, self.describe = timeout_s, describe
        self.last = None
        self.step = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="mambalab-watchdog")

    def start(self):
        self._thread.start()
        return self

    def beat(self, step: int) -> None:
        self.last, self.step = time.monotonic(), step

    def stop(self) -> None:
        """Stop the thread and wait for it, so that nothing it refers to outlives the run."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self):
        while not self._stop.wait(min(1.0, self.timeout_s / 4)):
            if self.last is not None and time.monotonic() - self.last > self.timeout_s:
                print(f"mambalab.train: {self.describe()}: no step finished for {self.timeout_s:.0f} s after step "
                      f"{self.step}; a peer rank has probably failed. Exiting.", file=sys.stderr, flush=True)
                os._exit(3)


def exit_on_peer_failure(error: Exception, layout, step: int) -> None:
    """Say plainly that this rank stopped at ``step`` because of ``error`` and exit (code 1); with one process
    there is no peer to blame, so the caller re-raises (this returns)."""
    if layout.world_size == 1:
        return
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    print(f"mambalab.train: {describe(layout)} stopped at step {step}: {type(error).__name__}: {first}\n"
          f"mambalab.train: another rank most likely failed or was killed; exiting.", file=sys.stderr, flush=True)
    os._exit(1)
