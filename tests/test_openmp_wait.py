from __future__ import annotations

import subprocess
import sys

from chatcli.cli.openmp_wait import SPIN_COUNT, choose_openmp_wait


def test_a_bounded_spin_is_set_when_the_user_chose_nothing():
    env: dict[str, str] = {}
    choose_openmp_wait(env)
    assert env == {"GOMP_SPINCOUNT": str(SPIN_COUNT)}


def test_the_users_wait_policy_or_spin_count_is_kept():
    for mine in ({"OMP_WAIT_POLICY": "PASSIVE"}, {"GOMP_SPINCOUNT": "0"}):
        env = dict(mine)
        choose_openmp_wait(env)
        assert env == mine


def test_the_cli_chooses_before_torch_is_imported():
    # `chatcli --help` must not import torch, and a run must have the spin set by then.
    code = (
        "import os, sys; sys.argv = ['chatcli', '--help']\n"
        "os.environ.pop('OMP_WAIT_POLICY', None); os.environ.pop('GOMP_SPINCOUNT', None)\n"
        "from chatcli.cli.app import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "print('torch' in sys.modules, os.environ.get('GOMP_SPINCOUNT'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines()[-1] == f"False {SPIN_COUNT}"
