"""The peers of the quant benchmark (bench/__init__.py), each set up from the case's x, 16-bit
W and our Int4Weight q: a setup function returns the state its call function times."""

from __future__ import annotations

import torch

from .. import reference
from ..format import Int4Weight

__all__ = [
    "setup_tinygemm",
    "run_tinygemm",
    "setup_bnb",
    "run_bnb",
    "setup_gemlite",
    "run_gemlite",
    "available",
]


def setup_tinygemm(s: dict) -> dict:
    """torch's tinygemm layout from our asymmetric int4 codes: W = (q - 8) * s + zero, so
    zero = (8 - z) * s; codes packed high nibble first, then tiled by the op."""
    q: Int4Weight = s["q"]
    packed = ((q.qweight & 0xF) << 4) | (q.qweight >> 4)
    tiled = torch.ops.aten._convert_weight_to_int4pack(packed.contiguous(), 8)
    scale = q.scales.to(torch.bfloat16)
    zero = ((8 - q.zeros.float()) * q.scales.float()).to(torch.bfloat16)
    return {
        "x": s["x"],
        "tiled": tiled,
        "sz": torch.stack((scale, zero), dim=-1).contiguous(),
        "group": q.group_size,
    }


def run_tinygemm(s: dict) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm(s["x"], s["tiled"], s["group"], s["sz"])


def setup_bnb(s: dict) -> dict:
    import bitsandbytes.functional as bf

    packed, state = bf.quantize_4bit(s["w"], blocksize=64, quant_type="nf4")
    return {"x": s["x"], "packed": packed, "state": state}


def run_bnb(s: dict) -> torch.Tensor:
    import bitsandbytes as bnb

    return bnb.matmul_4bit(s["x"], s["packed"].t(), quant_state=s["state"])


_gemlite_ready = False


def setup_gemlite(s: dict) -> dict:
    """GemLite's A16W4 layer from our int4 codes (its HQQ-style INT format has the same
    W = (q - zero) * scale). GemLite ships tuned configs by GPU name and has none for the H200:
    its H100 table is loaded instead of autotuning in the timed process."""
    global _gemlite_ready
    import os

    import gemlite
    from gemlite.helper import A16W4_HQQ_INT

    if not _gemlite_ready:
        name = torch.cuda.get_device_properties(0).name.lower()
        if "h200" in name:
            gemlite.load_config(os.path.join(os.path.dirname(gemlite.__file__), "configs", "h100.json"))
        _gemlite_ready = True
    q: Int4Weight = s["q"]
    codes = reference.unpack_codes(q.qweight).to(torch.uint8)
    dtype = s["x"].dtype
    layer = A16W4_HQQ_INT(device=str(q.device), dtype=dtype).from_weights(
        codes, q.scales.t().contiguous().to(dtype), q.zeros.t().contiguous().to(dtype)
    )
    return {"x": s["x"], "layer": layer}


def run_gemlite(s: dict) -> torch.Tensor:
    return s["layer"](s["x"])


def available(peer: str) -> bool:
    import importlib.util

    module = {"bnb-nf4": "bitsandbytes", "gemlite": "gemlite"}.get(peer)
    return module is None or importlib.util.find_spec(module) is not None
