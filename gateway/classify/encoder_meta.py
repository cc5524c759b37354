"""The encoder folder's description (encoder.json), read without torch: the cascade's band and
blend are plain numbers that a gateway without torch still validates (`gateway check`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .classifier import read_json

__all__ = ["ENCODER_DIR", "ENCODER_FORMAT", "meta_of"]

ENCODER_DIR = Path(__file__).with_name("encoder")  # the shipped encoder
ENCODER_FORMAT = "gateway-encoder/1"


def meta_of(folder: Path | None) -> dict[str, Any]:
    """encoder.json of an encoder folder (None: the shipped one), checked for its format; read
    without torch (the band and the blend are plain numbers). Raises ValueError naming the file."""
    p = (folder or ENCODER_DIR) / "encoder.json"
    doc = read_json(p, "encoder weights")
    if not isinstance(doc, dict) or doc.get("format") != ENCODER_FORMAT:
        raise ValueError(f"encoder weights {p}: format is not {ENCODER_FORMAT!r}")
    return doc
