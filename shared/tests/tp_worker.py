"""Worker for test_kernelize_tp.py (run by torch.distributed.run, 2 CPU processes, gloo):
`prepare DIR` saves a small Llama-style model and its single-process logits and greedy tokens;
`run DIR` loads it with transformers' tp_plan="auto" (DTensor parameters), kernelizes it and
writes this rank's logits and tokens next to the reference."""

from __future__ import annotations

import os
import sys

import torch

from openkernels.shared.kernelize import kernelize

CONFIG = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=256)  # fmt: skip


def _outputs(model) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(
            ids[:1, :8], max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0
        )
    return logits, tokens


def main(what: str, path: str) -> None:
    if what == "prepare":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**CONFIG, initializer_range=0.1)).eval()
        model.save_pretrained(path)
        torch.save(_outputs(model), os.path.join(path, "reference.pt"))
        return
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).eval()
    report = kernelize(model)
    kinds = sorted({type(p).__name__ for p in model.parameters()})
    logits, tokens = _outputs(model)
    rank = torch.distributed.get_rank()
    torch.save(dict(logits=logits, tokens=tokens, kinds=kinds, swapped=sorted(report.swapped)),
               os.path.join(path, f"rank{rank}.pt"))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
