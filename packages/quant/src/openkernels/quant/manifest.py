"""What openkernels-quant offers the shared tools (openkernels.shared.manifest)."""

from openkernels.shared.manifest import FamilyManifest

MANIFEST = FamilyManifest(
    name="quant",
    distribution="openkernels-quant",
    bench=("bench",),
    kernelize="openkernels.quant.kernelize:replacements",
    asv_suite="quant",
)
