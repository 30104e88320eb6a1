"""What openkernels-attention offers the shared tools (openkernels.shared.manifest)."""

from openkernels.shared.manifest import FamilyManifest

MANIFEST = FamilyManifest.standard("attention", bench=("core.bench", "kvcache.bench", "rotary.bench"))
