"""Numpy reference codecs of the microscaled weight and KV formats (see docs/quant.md).

- `elements`: FP8 E4M3 / E5M2, FP6 E2M3 / E3M2, FP4 E2M1 element codecs, the E8M0 scale, bfloat16.
- `packing`: FP4 / FP6 / FP8 codes into bytes along the last axis.
- `blocks`: MXFP8 / MXFP6 / MXFP4 / NVFP4 block formats, `QuantTensor`, `quantize` / `dequantize`.
- `gptq`: error-compensating quantisation of a [N, K] weight under a calibration Hessian.
- `kv`: `KVMode` (key bits / value bits) and the KV vector codecs of the paged pool.
- `presets`: per-tensor formats of the size presets and the bytes of a whole model.
"""

from __future__ import annotations

from decapybara.model.quant.blocks import (
    FORMATS,
    PARTS,
    BlockFormat,
    QuantTensor,
    dequantize,
    format_nbytes,
    get_format,
    nvfp4_tensor_scale,
    quantize,
    select_scales,
)
from decapybara.model.quant.elements import (
    E2M1,
    E2M3,
    E3M2,
    E4M3,
    E5M2,
    ELEMENT_FORMATS,
    ElementFormat,
    bf16_decode,
    bf16_encode,
    decode_elements,
    e8m0_decode,
    e8m0_encode,
    encode_elements,
)
from decapybara.model.quant.gptq import gptq_quantize
from decapybara.model.quant.kv import (
    KV_FORMATS,
    KV_MODES,
    KVMode,
    dequantize_kv,
    kv_storage_parts,
    kv_vector_bytes,
    quantize_kv,
)
from decapybara.model.quant.packing import pack_codes, packed_width, unpack_codes
from decapybara.model.quant.presets import PRESET_TABLE, PRESETS, preset_bytes, preset_formats, tensor_role

__all__ = [
    "E2M1", "E2M3", "E3M2", "E4M3", "E5M2", "ELEMENT_FORMATS", "FORMATS", "KV_FORMATS", "KV_MODES", "PARTS",
    "PRESETS", "PRESET_TABLE", "BlockFormat", "ElementFormat", "KVMode", "QuantTensor", "bf16_decode",
    "bf16_encode", "decode_elements", "dequantize", "dequantize_kv", "e8m0_decode", "e8m0_encode",
    "encode_elements", "format_nbytes", "get_format", "gptq_quantize", "kv_storage_parts", "kv_vector_bytes",
    "nvfp4_tensor_scale", "pack_codes", "packed_width", "preset_bytes", "preset_formats", "quantize",
    "quantize_kv", "select_scales", "tensor_role", "unpack_codes",
]
