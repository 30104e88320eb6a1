"""Greedy decode of a Llama-style model on the CPU through eager `generate()`: the unmodified
model, `kernelize(model)` and `kernelize(model, quantize="int4")`, one process, the same prompt
(float32, random weights, 4 layers; --hidden 512: the demo's decoder, 2048: Llama 3.2 1B's
width). Reports tok/s per variant in alternating rounds (new tokens over the generate() call's
time, the 16-token prompt's prefill included), and the fraction of the new tokens equal to the
unmodified model's (int4 weights change the logits, so its tokens part ways).

    python benchmarks/studies/cpu_llama_decode.py [--hidden 512|2048] [--new 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from openkernels.shared.kernelize import kernelize

SIZES = {
    512: dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=2),
    2048: dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, choices=sorted(SIZES), default=512)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, max_position_embeddings=4096, initializer_range=0.05,
                         num_hidden_layers=4, head_dim=64, **SIZES[args.hidden])  # fmt: skip
    plain = LlamaForCausalLM(config).eval()
    ours = copy.deepcopy(plain)
    kernelize(ours)
    int4 = copy.deepcopy(plain)
    print(kernelize(int4, quantize="int4"))
    variants = {"unmodified": plain, "kernelized": ours, "kernelized int4": int4}
    prompt = torch.randint(0, config.vocab_size, (1, 16))

    def generate(model: torch.nn.Module, new: int) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(
                prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
            )

    reference = generate(plain, args.new)
    for model in variants.values():
        generate(model, 4)  # warm-up
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, hidden {args.hidden}, {args.new} new tokens"
    )
    for round_ in range(args.rounds):
        for name, model in variants.items():
            start = time.perf_counter()
            tokens = generate(model, args.new)
            seconds = time.perf_counter() - start
            same = (tokens[:, prompt.shape[1] :] == reference[:, prompt.shape[1] :]).float().mean().item()
            print(
                f"round {round_}  {name:16s} {args.new / seconds:7.1f} tok/s  new tokens equal to unmodified {same:.2f}"
            )


if __name__ == "__main__":
    main()
