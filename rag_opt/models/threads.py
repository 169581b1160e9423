"""How many CPU threads a forward pass uses.

- ``"auto"`` (default): this worker's share of the cores this process may run on (``cores // workers``, for a
  server running several optimizer workers), never more than ``OMP_NUM_THREADS`` when that is set. Fixed for the
  process, so the same input always gives the same scores (the thread count changes the rounding of bf16 and
  fp32 sums: measured 0.3098 vs 0.3094 for one sentence with 1 and 2 threads in bf16).
- ``"adaptive"``: reads, just before each forward pass, how many other tasks are runnable on the machine
  (``/proc/loadavg``: an instantaneous count, unlike the load averages) and uses only the cores left free (at least
  one, at most the share above). On a shared CPU torch's one-thread-per-core collapses when other processes
  compete — two threads each waiting for a core took 1.5× as long as one here — and this avoids it, at the price
  of scores that vary in their last digits with the machine's load.
- a number: used as given.

Whatever the policy, a question pass (~25 tokens reading cached states) runs on :data:`QUESTION_PASS_THREADS` thread
under ``"auto"`` and ``"adaptive"``: its products are too small to share, and a second thread only adds its
synchronisation (warm requests on the 2-core CI machine, 8 document sets, medians: 142-158 ms on one thread against
392-448 ms on two while other processes ran; 78 against 135-167 ms on a quiet machine, issue 51's profile).

The policy is per loaded model, hence per process (torch's thread count is process-wide; forward passes of one
model are serialised anyway).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from rag_opt.errors import InvalidInputError

__all__ = ["QUESTION_PASS_THREADS", "ThreadPolicy", "available_cores", "runnable_others"]

QUESTION_PASS_THREADS = 1


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and ``taskset`` restrict)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def runnable_others(own: int = 1) -> int | None:
    """Runnable tasks on the machine other than ``own`` of ours, from ``/proc/loadavg`` (None where unknown)."""
    try:
        with open("/proc/loadavg", encoding="ascii") as fh:
            running = int(fh.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(running - own, 0)


@dataclass(frozen=True)
class ThreadPolicy:
    """``threads``: ``"auto"``, ``"adaptive"`` (see the module docstring) or a fixed count; ``workers``: how many
    forward passes this process may run at once (each gets its share of the cores)."""

    threads: int | str = "auto"
    workers: int = 1

    def __post_init__(self) -> None:
        if self.threads not in ("auto", "adaptive") and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int)
        ):
            raise InvalidInputError(f"threads must be 'auto', 'adaptive' or a positive integer, got {self.threads!r}")
        if isinstance(self.threads, int) and self.threads < 1:
            raise InvalidInputError(f"threads must be at least 1, got {self.threads}")
        if self.workers < 1:
            raise InvalidInputError(f"workers must be at least 1, got {self.workers}")

    def choose(self) -> int:
        """The thread count for the next forward pass."""
        if isinstance(self.threads, int):
            return self.threads
        share = max(available_cores() // self.workers, 1)
        cap = os.environ.get("OMP_NUM_THREADS", "")
        if cap.isdigit() and int(cap) > 0:
            share = min(share, int(cap))
        if self.threads == "auto":
            return share
        others = runnable_others()
        if others is None:
            return share
        return max(1, min(share, available_cores() - others))

    def apply(self, cap: int | None = None) -> int:
        """Set torch's intra-op threads for the next forward pass (only when it changes); returns the count.
        ``cap``: at most that many under ``"auto"`` and ``"adaptive"`` (a small pass, such as a question pass, runs
        faster on one thread than on several; a count given explicitly is used as given)."""
        import torch

        n = self.choose()
        if cap is not None and not isinstance(self.threads, int):
            n = min(n, cap)
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        return n
