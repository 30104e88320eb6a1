"""What openkernels-activations offers the shared tools (openkernels.shared.manifest)."""

from openkernels.shared.manifest import FamilyManifest

MANIFEST = FamilyManifest(
    name="activations",
    distribution="openkernels-activations",
    bench=("bench",),
    kernelize="openkernels.activations.kernelize:replacements",
    asv_suite="activations",
)
