"""Wire formats for pseudo-gradients. Accumulation is always fp32; only what crosses the network is compressed."""

from __future__ import annotations

from hivemind.compression import CompressionBase, Float16Compression, NoCompression

# name -> codec. fp16 halves the bytes of fp32; DiLoCo's pseudo-gradients lose nothing measurable to it
# (OpenDiLoCo, section 4). More codecs come later; a name added here must be added to the config's choices.
COMPRESSIONS = {
    "none": NoCompression,
    "fp16": Float16Compression,
}


def get_compression(name: str) -> CompressionBase:
    try:
        return COMPRESSIONS[name]()
    except KeyError:
        raise ValueError(f"unknown compression {name!r}; use one of: {', '.join(COMPRESSIONS)}") from None
