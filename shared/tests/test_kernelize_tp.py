"""kernelize under tensor parallelism: transformers' tp_plan="auto" (DTensor parameters) on
two CPU processes (gloo) gives the single-process model's logits and greedy tokens, in float32
and with int4 weights (each rank quantizes its shard). The same check on two GPUs over NCCL is
benchmarks/peers/tp_kernelize.py."""

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


def _tp(path: Path, what: str, port: int) -> None:
    _run("-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
         str(WORKER), what, str(path))  # fmt: skip


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """The saved model and its single-process references (one process, shared by the tests)."""
    path = tmp_path_factory.mktemp("tp")
    _run(str(WORKER), "prepare", str(path))
    return path


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_tensor_parallel_kernelized_matches_one_process(prepared):
    tmp_path = prepared
    _tp(tmp_path, "run", 29517)
    ref_logits, ref_tokens = torch.load(tmp_path / "reference.pt")
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["kinds"] == ["DTensor", "Parameter"]  # the projections really are sharded
        assert {"activations.gated_mlp", "attention.qkv_rotary", "layernorm.rms_norm"} <= set(got["swapped"])
        torch.testing.assert_close(got["logits"], ref_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(got["tokens"], ref_tokens)


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_tensor_parallel_int4_quantizes_each_shard(prepared):
    pytest.importorskip("openkernels.quant")
    tmp_path = prepared
    _tp(tmp_path, "run-int4", 29518)
    ref_logits, ref_tokens, ref_buffers = torch.load(tmp_path / "reference_int4.pt")
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}_int4.pt")
        # Refused before anything changes: quantize="int4" (group size 128), as o_proj's K = 128
        # is split 64 + 64 over the ranks and a group would straddle them; and lm_head (not
        # skipped), whose hook gathers the output from the ranks' shards.
        group, lm_head = got["refusals"]
        assert "layer 'model.layers.0.self_attn.o_proj'" in group
        assert "row-parallel" in group and "group_size 128 does not divide" in group
        assert "use group_size 32 or 64" in group
        assert "layer 'lm_head'" in lm_head and "output layout Replicate()" in lm_head
        assert got["untouched"] and got["restored"]  # and unkernelize gives every parameter back
        # A sharded layer without transformers' hook has no all-reduce to keep: refused too.
        assert "is not transformers' ColwiseParallel / RowwiseParallel hook" in got["unhooked"]
        assert got["kinds"] == ["DTensor", "Parameter"]
        assert {"quant.int4_linear", "activations.gated_mlp", "attention.qkv_rotary"} <= set(got["swapped"])
        # Each rank's codes, scales and zeros are exactly the one-process model's, sliced: rows
        # (N, the scales' columns) of column-parallel layers, K (the groups) of row-parallel ones.
        assert got["buffers"].keys() == ref_buffers.keys() and len(ref_buffers) == 14
        for name, (qweight, scales, zeros) in ref_buffers.items():
            row_parallel = name.endswith(("o_proj", "down_proj"))
            expected = (
                (qweight.chunk(2, 1)[rank], scales.chunk(2, 0)[rank], zeros.chunk(2, 0)[rank])
                if row_parallel
                else (qweight.chunk(2, 0)[rank], scales.chunk(2, 1)[rank], zeros.chunk(2, 1)[rank])
            )
            for mine, theirs in zip(got["buffers"][name], expected):
                assert torch.equal(mine, theirs), name
        # The same weights: only the order of the sums differs (each rank's half of K, then the
        # all-reduce), float32 rounding, as in the 16-bit test above.
        torch.testing.assert_close(got["logits"], ref_logits, rtol=1e-4, atol=1e-4)
        assert torch.equal(got["tokens"], ref_tokens)
