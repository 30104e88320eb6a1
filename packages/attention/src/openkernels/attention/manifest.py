"""What openkernels-attention offers the shared tools (openkernels.shared.manifest)."""

from openkernels.shared.manifest import FamilyManifest

MANIFEST = FamilyManifest(
    name="attention",
    distribution="openkernels-attention",
    bench=("bench", "bench_kvcache", "bench_rotary"),
    kernelize="openkernels.attention.kernelize:replacements",
    asv_suite="attention",
)
