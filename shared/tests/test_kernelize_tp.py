"""kernelize under tensor parallelism: transformers' tp_plan="auto" (DTensor parameters) on
two CPU processes (gloo) gives the single-process model's logits and greedy tokens. The same
check on two GPUs over NCCL is benchmarks/peers/tp_kernelize.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # transformers needs it for tp_plan
for _family in ("activations", "layernorm", "attention"):
    pytest.importorskip(f"openkernels.{_family}")

WORKER = Path(__file__).with_name("tp_worker.py")


def _run(*args: str, timeout: int = 300) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_tensor_parallel_kernelized_matches_one_process(tmp_path):
    _run(str(WORKER), "prepare", str(tmp_path))
    _run("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517",
         str(WORKER), "run", str(tmp_path))  # fmt: skip
    ref_logits, ref_tokens = torch.load(tmp_path / "reference.pt")
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["kinds"] == ["DTensor", "Parameter"]  # the projections really are sharded
        assert {"activations.gated_mlp", "attention.qkv_rotary", "layernorm.rms_norm"} <= set(got["swapped"])
        torch.testing.assert_close(got["logits"], ref_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(got["tokens"], ref_tokens)
