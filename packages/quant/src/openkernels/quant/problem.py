"""The quant family's rules on shapes, dtype names and options alone (its framework-neutral
problem module, as in every family), shared by the PyTorch (format.py, api.py) and JAX
(jax/format.py, jax/__init__.py) faces: each face describes its arrays as `Part`s and adds
only what is its own (array types, devices).

The 4-bit weight:

    qweight  (N, K // 2) uint8, two codes per byte
    scales   (K // group_size, N) float16 or bfloat16
    zeros    (K // group_size, N) in the scales' dtype, or None (symmetric int4, nf4)
    perm     (K,) act-order permutation (int64; JAX takes int32 too), or None
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "OPS",
    "KINDS",
    "SCALE_DTYPES",
    "X_DTYPES",
    "Part",
    "check_parts",
    "check_x_dtype",
    "check_linear_call",
    "resolve_group_size",
    "check_quantize_options",
    "clip_ratios",
    "Int4Shape",
]

# The op table: each op's public function (api.py, jax/), its library op openkernels::<op>
# and its reference <op>_ref (reference.py); benchmark variants are the weight kinds below.
OPS = ("int4_linear", "dequantize_int4")
KINDS = ("int4", "nf4")
SCALE_DTYPES = ("float16", "bfloat16")
X_DTYPES = ("float16", "bfloat16", "float32", "float64")  # activations and dequantized weights


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
    if k % 2:
        raise ValueError(f"{where}: in_features {k} must be even (two 4-bit codes per byte)")
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


def check_x_dtype(what: str, dtype: str | None, shown: object) -> None:
    """Raise TypeError unless `dtype` (a name) is one of X_DTYPES. what: "int4_linear: x",
    "dequantize_int4: dtype"; shown: the dtype as the face prints it."""
    if dtype not in X_DTYPES:
        raise TypeError(f"{what} must be float16, bfloat16, float32 or float64, got {shown}")


def check_linear_call(
    x_shape: tuple[int, ...], bias: Part | object | None, out_features: int, in_features: int, *, noun: str
) -> None:
    """int4_linear's rules on x (..., K) and bias (N,): raise ValueError naming the argument.
    bias: a Part, None, or what the caller passed when it is not an array of the face (noun:
    "tensor" or "jax.Array")."""
    n, k = out_features, in_features
    if len(x_shape) == 0 or x_shape[-1] != k:
        raise ValueError(
            f"int4_linear: x has shape {tuple(x_shape)}, its last dimension must be in_features {k}"
        )
    if bias is None:
        return
    if not isinstance(bias, Part) or not _is_float(bias.dtype) or tuple(bias.shape) != (n,):
        got = f"{tuple(bias.shape)} {bias.dtype}" if isinstance(bias, Part) else type(bias).__name__
        raise ValueError(f"int4_linear: bias must be a float {noun} of shape ({n},), got {got}")


def _is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


def resolve_group_size(group_size: int | None, in_features: int) -> int:
    """None or -1 means one group per row (the whole of K)."""
    return in_features if group_size in (None, -1) else group_size


def check_quantize_options(
    in_features: int, group_size: int, search: object, grid: int, min_ratio: float
) -> None:
    """quantize_int4 / quantize_nf4's rules on their options (group_size resolved): raise
    ValueError naming the option."""
    k = in_features
    if k <= 0:
        raise ValueError(f"in_features must be positive, got {k}")
    if k % 2:
        raise ValueError(f"in_features {k} must be even: two 4-bit codes are packed per byte")
    if type(group_size) is not int or group_size not in (32, 64, 128, k) or k % group_size:
        raise ValueError(
            f"group_size {group_size} must be 32, 64, 128 or None (whole row) and divide in_features {k}"
        )
    if search not in (None, "clip"):
        raise ValueError(f"search must be None or 'clip', got {search!r}")
    if not 0 < min_ratio <= 1 or grid < 1:
        raise ValueError(f"min_ratio must be in (0, 1] and grid >= 1, got {min_ratio}, {grid}")


def clip_ratios(search: str | None, grid: int, min_ratio: float) -> list[float]:
    """The clip ratios a quantizer tries, 1.0 (round to nearest) first; with search="clip",
    `grid` steps down to min_ratio."""
    steps = 1 if search is None else grid + 1
    return [1.0 - (1.0 - min_ratio) * i / grid for i in range(steps)]


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
