"""Worker for test_kernelize_tp.py (run by torch.distributed.run, 2 CPU processes, gloo):
`prepare DIR` saves a small Llama-style model and its single-process logits and greedy tokens,
unmodified and (with openkernels-quant) kernelized with int4 weights of group size 64;
`run DIR` loads it with transformers' tp_plan="auto" (DTensor parameters), kernelizes it and
writes this rank's logits and tokens next to the reference;
`run-int4 DIR` does the same with quantize="int4": first two refused calls (the default group size
128, which does not divide the 64 columns of o_proj each rank holds; lm_head not skipped, whose
hook gathers its output), whose errors are written with whether the model is untouched, then
group size 64 (this rank's int4 buffers are written too); and quantize_model on a sharded
nn.Linear that transformers did not hook (refused)."""

from __future__ import annotations

import importlib.util
import os
import sys

import torch

from openkernels.shared.kernelize import kernelize, local_tensor, unkernelize

# Biases on every projection: the row-parallel bias must be added once, after the all-reduce.
CONFIG = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=256, attention_bias=True,
              mlp_bias=True)  # fmt: skip
# Group size 64 divides each rank's share of o_proj's K (64) and of down_proj's (128).
INT4 = {"kind": "int4", "group_size": 64}


def _outputs(model) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = model(ids).logits
        tokens = model.generate(
            ids[:1, :8], max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0
        )
    return logits, tokens


def _int4_buffers(model) -> dict[str, tuple[torch.Tensor, ...]]:
    from openkernels.quant import Int4Linear

    return {
        name: (m.qweight, m.scales, m.zeros) for name, m in model.named_modules() if isinstance(m, Int4Linear)
    }


def _snapshot(model) -> tuple[dict, dict]:
    """name -> (parameter object, a copy of this rank's values); module name -> (module, its
    instance forward: transformers' tensor-parallel hook, or None)."""
    params = {name: (p, local_tensor(p).detach().clone()) for name, p in model.named_parameters()}
    return params, {name: (m, m.__dict__.get("forward")) for name, m in model.named_modules()}


def _same(before: tuple[dict, dict], now: tuple[dict, dict]) -> bool:
    """The same modules, hooks and parameter objects, with the same values."""
    (params, modules), (now_params, now_modules) = before, now
    return (
        params.keys() == now_params.keys()
        and all(now_params[n][0] is p and torch.equal(now_params[n][1], v) for n, (p, v) in params.items())
        and modules.keys() == now_modules.keys()
        and all(now_modules[n][0] is m and now_modules[n][1] is f for n, (m, f) in modules.items())
    )


def _unhooked_refusal(mesh) -> str:
    """quantize_model's error for a sharded nn.Linear that transformers did not hook (no
    all-reduce it could keep)."""
    from torch import nn
    from torch.distributed.tensor import Shard, distribute_tensor

    from openkernels.quant import quantize_model

    layer = nn.Linear(256, 32, bias=False)
    layer.weight = nn.Parameter(distribute_tensor(layer.weight.detach(), mesh, [Shard(1)]))
    try:
        quantize_model(nn.Sequential(layer), progress=False)
    except ValueError as error:
        return str(error)
    return "not refused"


def main(what: str, path: str) -> None:
    if what == "prepare":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(**CONFIG, initializer_range=0.1)).eval()
        model.save_pretrained(path)
        torch.save(_outputs(model), os.path.join(path, "reference.pt"))
        if importlib.util.find_spec("openkernels.quant") is None:
            return
        kernelize(model, quantize=INT4)
        torch.save((*_outputs(model), _int4_buffers(model)), os.path.join(path, "reference_int4.pt"))
        return
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32).eval()
    rank = torch.distributed.get_rank()
    kinds = sorted({type(p).__name__ for p in model.parameters()})
    if what == "run":
        report = kernelize(model)
        logits, tokens = _outputs(model)
        torch.save(dict(logits=logits, tokens=tokens, kinds=kinds, swapped=sorted(report.swapped)),
                   os.path.join(path, f"rank{rank}.pt"))  # fmt: skip
        return
    before = _snapshot(model)
    refusals = []
    # quantize="int4": group size 128 > o_proj's 64 columns per rank; lm_head not skipped:
    # its hook gathers the output (colwise_gather_output), which the local shard cannot keep.
    for quantize in ("int4", {**INT4, "skip": ()}):
        try:
            kernelize(model, quantize=quantize)
            refusals.append(None)
        except ValueError as error:
            refusals.append(str(error))
    untouched = _same(before, _snapshot(model))
    unhooked = _unhooked_refusal(model.model.layers[0].mlp.gate_proj.weight.device_mesh)
    report = kernelize(model, quantize=INT4)
    logits, tokens = _outputs(model)
    buffers = _int4_buffers(model)
    unkernelize(model)
    restored = _same(before, _snapshot(model))
    torch.save(dict(logits=logits, tokens=tokens, kinds=kinds, swapped=sorted(report.swapped), refusals=refusals,
                    untouched=untouched, unhooked=unhooked, buffers=buffers, restored=restored),
               os.path.join(path, f"rank{rank}_int4.pt"))  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
