"""Attention dropout in full (not causal) calls on the fast path's plain configs (issue 23: the
options at most 10% slower than the plain call; BERT-style fine-tuning trains with dropout 0.1).
Every option used to send the Hopper D128 backward to the override configs for options
(configs._OPTIONS_TABLE: 32 x 128 dK/dV and 128 x 32 dQ tiles); attention 0.8.7 keeps ALiBi
alone and a softcap alone on the plain 64 x 128 / 128 x 64 tiles, which measured 1.16-1.30x ->
1.04-1.13x of the plain call's forward+backward. Dropout alone in a full call compiles without
spills there too (sm_90, 255 registers; causal dropout spills 24 B): this times it, each
variant in its own process, Triton forced, beside the same call without dropout.

Variants:
  override  attention 0.8.7's default (problem.FULL_DROPOUT_ON_PLAIN_CONFIGS False).
  plain     full calls with dropout alone on the plain configs (the flag set: the default
            since attention 0.8.8, after this study's H100 run, docs/perf.md).

Correctness of the plain configs with dropout: `pytest packages/attention/tests/test_dropout.py
-k "plain_configs and cuda"` (against the float64 reference drawing the same mask).

    PYTHONPATH=$PWD/shared/src:$(printf '%s:' $PWD/packages/*/src) \\
        python3 benchmarks/studies/attention_dropout_configs.py [variant ...]
"""

from __future__ import annotations

import sys

from attention_option_cost import cost_table, run_variants

from openkernels.attention.core import problem

VARIANTS = ("override", "plain")
DROPOUT = 0.1


def run_variant(name: str) -> int:
    problem.FULL_DROPOUT_ON_PLAIN_CONFIGS = name == "plain"
    cost_table(name, "drop", lambda heads: {"dropout_p": DROPOUT})
    return 0


if __name__ == "__main__":
    sys.exit(run_variants(sys.argv[1:], VARIANTS, run_variant, __file__))
