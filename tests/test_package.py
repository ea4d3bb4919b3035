from __future__ import annotations

import subprocess
import sys


def test_importing_torch_through_chatcli_prints_no_numpy_warning():
    # chatcli needs no numpy; torch's "Failed to initialize NumPy" warning where it is
    # missing used to open every command's stderr. Where numpy is installed torch is quiet
    # anyway, and this still holds.
    code = "import chatcli, chatcli.model.checkpoint, torch; torch.zeros(1).tolist()"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "NumPy" not in done.stderr


def test_the_package_names_its_version_and_loads_models_lazily():
    import chatcli

    assert chatcli.__version__.count(".") == 2
    assert callable(chatcli.load_model)
