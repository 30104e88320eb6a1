"""What openkernels-layernorm offers the shared tools (openkernels.shared.manifest)."""

from openkernels.shared.manifest import FamilyManifest

MANIFEST = FamilyManifest(
    name="layernorm",
    distribution="openkernels-layernorm",
    bench=("bench",),
    kernelize="openkernels.layernorm.kernelize:replacements",
    asv_suite="layernorm",
)
