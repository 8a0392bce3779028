"""examples/moe_layer.py trains the same loss curve with epx as with plain torch (CPU backend)."""

import os
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "moe_layer.py")


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_example_loss_curves_agree(ranks):
    run = subprocess.run([sys.executable, EXAMPLE, "--ranks", str(ranks), "--steps", "8"], capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "the same curve" in run.stdout
