"""Test-wide set-up: runs before any test module imports torch."""

import os

# Passive OpenMP waits: spinning threads slow every op 10-60x when another process is busy on
# these 2 cores (docs/performance.md), and CI shares them.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
