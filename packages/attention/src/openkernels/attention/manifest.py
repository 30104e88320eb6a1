"""What openkernels-attention offers the shared tools (openkernels.shared.manifest)."""

from openkernels.shared.manifest import FamilyManifest

MANIFEST = FamilyManifest.standard("attention", bench=("bench", "bench_kvcache", "rotary.bench"))
