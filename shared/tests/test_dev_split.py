"""The runtime of openkernels-shared stays apart from its development tools: importing a
family, calling its ops and kernelizing a model never loads `openkernels.shared.dev` (the CLI,
benchmark helpers, test utilities), so users pay for none of it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

FAMILIES = ["activations", "layernorm", "quant", "attention"]


@pytest.mark.parametrize("family", FAMILIES)
def test_importing_a_family_leaves_the_dev_tools_unloaded(family: str) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        import torch
        import openkernels.{family} as fam
        import openkernels.shared.kernelize, openkernels.shared.dispatch
        if {family!r} == "activations":
            fam.gelu(torch.randn(4, 8))
        elif {family!r} == "layernorm":
            fam.rms_norm(torch.randn(4, 8), torch.ones(8))
        loaded = sorted(m for m in sys.modules if m.startswith("openkernels.shared.dev"))
        print(",".join(loaded))
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "", f"openkernels.{family} loaded {run.stdout.strip()}"
