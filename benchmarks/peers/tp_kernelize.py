"""A kernelized Llama-style model under tensor parallelism (transformers' tp_plan, DTensor,
NCCL) gives the same outputs as on one GPU.

    python benchmarks/peers/tp_kernelize.py prepare DIR          # one GPU: save model + reference
    torchrun --nproc-per-node 2 benchmarks/peers/tp_kernelize.py run DIR

prepare builds a small Llama-style model (random bf16 weights), saves it, and records on
one GPU the unmodified, the kernelized and the int4-kernelized (quantize="int4", group size
128) logits and greedy tokens. run loads it with tp_plan="auto" on every rank, kernelizes,
and compares; then unkernelizes, kernelizes with int4 weights (each rank quantizes its own
shard: the one-GPU model's codes and scales, sliced) and compares against the one-GPU int4
model. Rank 0 prints the verdict; exit 1 on a mismatch beyond bf16 tolerance.
"""

from __future__ import annotations

import os
import sys

import torch

from openkernels.shared.kernelize import kernelize, unkernelize

CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=4,
              num_attention_heads=16, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048)  # fmt: skip
NEW_TOKENS = 32
# Group size 128 divides each of 2 ranks' share of o_proj's K (512) and down_proj's (2048).
INT4 = {"kind": "int4", "group_size": 128}


def _inputs() -> torch.Tensor:
    return torch.randint(0, CONFIG["vocab_size"], (2, 256), generator=torch.Generator().manual_seed(3))


def _run(model, device) -> tuple[torch.Tensor, torch.Tensor]:
    ids = _inputs().to(device)
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits.float()
        tokens = model.generate(ids[:1, :16], max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                do_sample=False, pad_token_id=0)  # fmt: skip
    return logits.cpu(), tokens.cpu()


def prepare(path: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG, initializer_range=0.05)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    model = model.cuda().eval()
    ref_logits, ref_tokens = _run(model, "cuda")
    kernelize(model)
    k_logits, k_tokens = _run(model, "cuda")
    unkernelize(model)
    kernelize(model, quantize=INT4)
    q_logits, q_tokens = _run(model, "cuda")
    torch.save(dict(ref_logits=ref_logits, ref_tokens=ref_tokens, k_logits=k_logits, k_tokens=k_tokens,
                    q_logits=q_logits, q_tokens=q_tokens), os.path.join(path, "reference.pt"))  # fmt: skip
    print(f"prepared {path}: one-GPU kernelized vs unmodified max |dlogit| "
          f"{(k_logits - ref_logits).abs().max().item():.4f} (max |logit| {ref_logits.abs().max().item():.2f}); "
          f"greedy tokens equal {bool(torch.equal(k_tokens, ref_tokens))}; int4 vs unmodified max |dlogit| "
          f"{(q_logits - ref_logits).abs().max().item():.4f}")  # fmt: skip


def run(path: str) -> int:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.bfloat16).eval()
    rank = torch.distributed.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    ref = torch.load(os.path.join(path, "reference.pt"))
    tp_logits, tp_tokens = _run(model, device)
    report = kernelize(model)
    ktp_logits, ktp_tokens = _run(model, device)
    unkernelize(model)
    q_report = kernelize(model, quantize=INT4)
    qtp_logits, qtp_tokens = _run(model, device)
    ok = True
    if rank == 0:
        print(report)
        print(q_report)
        dtypes = {type(p).__name__ for p in model.parameters()}
        print(f"world size {torch.distributed.get_world_size()}, parameter types {sorted(dtypes)}")
        scale = ref["ref_logits"].abs().max().item()
        rows = [
            ("TP unmodified vs 1-GPU unmodified", tp_logits, ref["ref_logits"], tp_tokens, ref["ref_tokens"]),
            ("TP kernelized vs 1-GPU kernelized", ktp_logits, ref["k_logits"], ktp_tokens, ref["k_tokens"]),
            ("TP kernelized vs TP unmodified", ktp_logits, tp_logits, ktp_tokens, tp_tokens),
            ("TP int4 vs 1-GPU int4", qtp_logits, ref["q_logits"], qtp_tokens, ref["q_tokens"]),
        ]
        for label, a, b, ta, tb in rows:
            diff = (a - b).abs().max().item()
            same = float((ta == tb).float().mean())
            print(
                f"{label:<36} max |dlogit| {diff:.4f} (max |logit| {scale:.2f}), greedy tokens equal {same:.3f}"
            )
        # bf16 tolerance: the TP run's own distance to the 1-GPU run bounds what rounding does.
        base = (tp_logits - ref["ref_logits"]).abs().max().item()
        ours = (ktp_logits - ref["k_logits"]).abs().max().item()
        # int4: the same codes and scales on both sides, so the same bf16 bound holds.
        ours_int4 = (qtp_logits - ref["q_logits"]).abs().max().item()
        ok = max(ours, ours_int4) <= 2 * base + 0.05 * scale
        print("verdict:", "same outputs within bf16 tolerance" if ok else "MISMATCH")
    torch.distributed.barrier()
    return 0 if ok else 1


if __name__ == "__main__":
    what, where = sys.argv[1], sys.argv[2]
    sys.exit(prepare(where) if what == "prepare" else run(where))
