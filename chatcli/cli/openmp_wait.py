"""How torch's OpenMP threads wait between parallel regions: decided before torch loads.

Owns: the environment libgomp reads once, when torch is imported (libgomp is the OpenMP
runtime of PyTorch's Linux wheels, and MKL's threads run on it too). Knows nothing about
torch, which it must not import: it runs first.

- A worker that sleeps as soon as a parallel region ends (OMP_WAIT_POLICY=PASSIVE) must be
  woken for the next one, and the ~80 products of a big model's token pay that wake: no
  faster than one thread.
- A worker that spins a bounded while (GOMP_SPINCOUNT) is still awake when the next product
  starts, so it spins.
- Spinning costs dearly while another process is busy on the same cores (libgomp's default
  spins ~3 ms). The decode step therefore measures whether its second thread pays and drops
  to one thread when it does not (cpu_plan.ThreadChoice); a small model's step starts on one
  thread and forks only where its products measure faster on two. The figures:
  docs/performance-notes.md, "OpenMP's wait".
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# libgomp counts ~100k spins per millisecond (its own estimate, within 5x either way): about
# 1 ms, enough to bridge the ops between a step's products, a third of libgomp's default.
SPIN_COUNT = 100_000


def choose_openmp_wait(environ: MutableMapping[str, str] = os.environ) -> None:
    """Set a bounded OpenMP spin unless the user chose a wait policy or spin count."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return
    environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
