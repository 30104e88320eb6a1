"""The 4-bit weight's layout rules on shapes and dtype names alone (this family's framework-neutral
problem module, as in every family), shared by the PyTorch
(format.py) and JAX (jax_format.py) faces: each face describes its arrays as `Part`s and
adds only what is its own (array types, devices).

    qweight  (N, K // 2) uint8, two codes per byte
    scales   (K // group_size, N) float16 or bfloat16
    zeros    (K // group_size, N) in the scales' dtype, or None (symmetric int4, nf4)
    perm     (K,) act-order permutation (int64; JAX takes int32 too), or None
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["KINDS", "SCALE_DTYPES", "Part", "check_parts", "Int4Shape"]

KINDS = ("int4", "nf4")
SCALE_DTYPES = ("float16", "bfloat16")


class Part(NamedTuple):
    """An array's shape and dtype name ("uint8", "bfloat16", ...)."""

    shape: tuple[int, ...]
    dtype: str


def check_parts(
    qweight: Part,
    scales: Part,
    zeros: Part | None,
    group_size: object,
    kind: object,
    perm: Part | None,
    *,
    perm_dtypes: tuple[str, ...] = ("int64",),
    in_features: int | None = None,
    where: str = "Int4Weight",
    noun: str = "tensor",
) -> int:
    """Raise ValueError / TypeError naming the part when the parts do not form a valid
    weight; return in_features (K). noun: "tensor" or "array", as the face says it."""
    if kind not in KINDS:
        raise ValueError(f"{where}: kind must be one of {KINDS}, got {kind!r}")
    if qweight.dtype != "uint8" or len(qweight.shape) != 2:
        raise TypeError(
            f"{where}: qweight must be a 2D uint8 {noun} (N, K // 2), got {len(qweight.shape)}D {qweight.dtype}"
        )
    n, half_k = qweight.shape
    k = 2 * half_k if in_features is None else in_features
    if k != 2 * half_k:
        raise ValueError(f"{where}: qweight has {half_k} bytes per row, in_features {k} needs {k // 2}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size <= 0 or k % group_size:
        raise ValueError(f"{where}: group_size {group_size} must be a positive divisor of in_features {k}")
    if group_size % 2:
        raise ValueError(f"{where}: group_size {group_size} must be even (two codes per byte)")
    groups = k // group_size
    if scales.dtype not in SCALE_DTYPES:
        raise TypeError(f"{where}: scales must be float16 or bfloat16, got {scales.dtype}")
    if tuple(scales.shape) != (groups, n):
        raise ValueError(
            f"{where}: scales has shape {tuple(scales.shape)}, expected (in_features // group_size, "
            f"out_features) = ({groups}, {n})"
        )
    if zeros is not None:
        if kind == "nf4":
            raise ValueError(f"{where}: nf4 weights have no zeros")
        if zeros.dtype != scales.dtype or tuple(zeros.shape) != (groups, n):
            raise ValueError(
                f"{where}: zeros must match scales ({groups}, {n}) {scales.dtype}, got "
                f"{tuple(zeros.shape)} {zeros.dtype}"
            )
    if perm is not None and (perm.dtype not in perm_dtypes or tuple(perm.shape) != (k,)):
        raise ValueError(
            f"{where}: perm must be an {' or '.join(perm_dtypes)} ({k},) permutation, got "
            f"{tuple(perm.shape)} {perm.dtype}"
        )
    return k


class Int4Shape:
    """What both faces' Int4Weight derive from their parts."""

    qweight: object
    zeros: object
    perm: object
    kind: str
    group_size: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]  # type: ignore[attr-defined]

    @property
    def in_features(self) -> int:
        return 2 * self.qweight.shape[1]  # type: ignore[attr-defined]

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features): the shape of the dequantized weight."""
        return (self.out_features, self.in_features)

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    def describe(self, name: str, scales: str) -> str:
        """The repr of either face: `scales` is what it says of the scales (dtype, device)."""
        zeros = "symmetric" if self.zeros is None else "zeros"
        perm = ", act-order" if self.perm is not None else ""
        return (
            f"{name}({self.kind}, {self.out_features}x{self.in_features}, group_size={self.group_size}, "
            f"{zeros}, scales {scales}{perm})"
        )
