"""Every GGUF tensor type a packed load meets: the precision class it keeps under quantization "auto"
(`auto_mode`), whether our CPU kernels multiply it from its own blocks (`has_kernel`), and the memory it
takes after loading (`resident_bytes`), for the loader's memory check and the warning about types
without a kernel (`no_kernel_warning`).

| GGUF type          | file bits/weight | our CPU form (exact)                       | bits/weight loaded |
| Q4_0, Q4_1         | 4.5-5            | q4: nibbles, d and m (float16) per 32      | 5                  |
| Q4_K               | 4.5              | q4k: nibbles, 6-bit sc and mn per 32, d and dmin (float16) per 256 | 4.625 |
| Q5_0               | 5.5              | q8: int8 q - 16, d (float16) per 32        | 8.5                |
| Q5_1, Q5_K         | 5.5-6            | q8m: int8 q, d and m per 32                | 10                 |
| Q6_K               | 6.5625           | q6k: 6-bit q, int8 sc per 16, d (float16) per 256 | 6.5625      |
| Q8_0               | 8.5              | q8: int8 q, d (float16) per 32             | 8.5                |
| IQ*, Q2_K, Q3_K, TQ* and others | 1.6-4.5 | none: dequantized, then q8 by absmax per 32 (not exact) | 9 |
"""

from __future__ import annotations

FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
# type -> (precision class under "auto", bits a weight once packed for our CPU kernels)
FORMS: dict[str, tuple[str, float]] = {
    "Q4_0": ("int4", 5.0), "Q4_1": ("int4", 5.0), "Q4_K": ("int4", 4.625),
    "Q5_0": ("int8", 8.5), "Q5_1": ("int8", 10.0), "Q5_K": ("int8", 10.0),
    "Q6_K": ("int8", 6.5625), "Q8_0": ("int8", 8.5),
}
INT4_BITS = 6.0  # any weight packed as int4: nibbles, d and m per 32
INT8_BITS = 9.0  # any weight quantized to q8 blocks: int8, d per 32
Q4_AS_INT8_BITS = 10.0  # a Q4 type asked for as int8: q8m, exact


def auto_mode(type_name: str) -> str:
    """The packed form a GGUF tensor type keeps under quantization="auto": "none" for float types; a
    type without a kernel is dequantized and packed as int8 (9 bits a weight, not 32 as fp32)."""
    if type_name in FLOAT_TYPES:
        return "none"
    return FORMS[type_name][0] if type_name in FORMS else "int8"


def has_kernel(type_name: str) -> bool:
    """Whether our CPU kernels multiply this type from its own blocks (exactly)."""
    return type_name in FORMS or type_name in FLOAT_TYPES


def resident_bytes(type_name: str, numel: int, mode: str = "auto") -> int:
    """Bytes `numel` weights of `type_name` take after a load packing them as `mode` ("auto", "int4",
    "int8", or "none": dense float32) on our CPU kernels."""
    if mode == "auto":
        mode = auto_mode(type_name)
    if mode == "none":
        bits = 32.0
    elif mode == "int4":
        bits = FORMS[type_name][1] if FORMS.get(type_name, ("",))[0] == "int4" else INT4_BITS
    elif type_name in FORMS:
        bits = Q4_AS_INT8_BITS if FORMS[type_name][0] == "int4" else FORMS[type_name][1]
    else:
        bits = INT8_BITS
    return int(numel * bits) // 8


def file_bytes(type_name: str, numel: int) -> int:
    """Bytes `numel` weights of `type_name` take in a GGUF file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    return numel // block * size


def no_kernel_warning(numels: dict[str, int], mode: str = "auto") -> str | None:
    """One line naming the types among `numels` (type -> weights of it a load packs) that have no kernel
    and the memory their dequantized form costs; None when every type has one."""
    missing = {t: n for t, n in sorted(numels.items()) if not has_kernel(t)}
    if not missing:
        return None
    held = sum(file_bytes(t, n) for t, n in missing.items())
    loaded = sum(resident_bytes(t, n, mode) for t, n in missing.items())
    form = "dense float32" if mode == "none" else "8-bit blocks (absmax per 32, not exact)"
    return (f"no kernel for GGUF type{'s' if len(missing) > 1 else ''} {', '.join(missing)}: "
            f"{sum(missing.values()) / 1e6:.1f}M weights dequantized to {form}, {loaded / 2**20:.1f} MiB "
            f"where the file holds {held / 2**20:.1f} MiB (+{(loaded - held) / 2**20:.1f} MiB)")
