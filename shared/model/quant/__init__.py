"""Group-wise int8/int4 quantized models and the QZO `scales` scope.

Importing this package registers the `scales` scope with `seedfed.shared.model.scopes`.
"""

from seedfed.shared.model.quant import scales_scope as _scales_scope  # noqa: F401  (registers the "scales" scope)
from seedfed.shared.model.quant.errors import (
                     GroupSizeError,
                     NoQuantizableLayersError,
                     QuantChecksumError,
                     QuantError,
                     QuantFileError,
)
from seedfed.shared.model.quant.groupwise import (
                     dequantize,
                     pack_int4,
                     qmax,
                     quantize_groups,
                     unpack_int4,
)
from seedfed.shared.model.quant.io import (
                     load_quantized,
                     load_scales,
                     save_quantized,
                     save_scales,
                     tensors_checksum,
)
from seedfed.shared.model.quant.linear import QuantLinear
from seedfed.shared.model.quant.model import (
                     DEFAULT_SKIP,
                     QuantConfig,
                     build_quantized,
                     materialize_rest,
                     quant_layers,
                     quantizable_layers,
                     quantize_model,
)
from seedfed.shared.model.quant.publish import (
                     PUBLISH_GROUP_SIZE,
                     publish,
                     publish_int4,
                     publish_int8,
                     read_published,
)
from seedfed.shared.model.quant.scales_scope import (
                     DEFAULT_DDC_CLIP,
                     DEFAULT_SCALE_FLOOR,
                     ScalesScope,
                     build_scales_scope,
                     plan_clip,
)

__all__ = [
    "DEFAULT_DDC_CLIP", "DEFAULT_SCALE_FLOOR", "DEFAULT_SKIP", "GroupSizeError",
    "NoQuantizableLayersError", "PUBLISH_GROUP_SIZE", "QuantChecksumError", "QuantConfig",
    "QuantError", "QuantFileError", "QuantLinear", "ScalesScope", "build_quantized",
    "build_scales_scope", "dequantize", "load_quantized", "load_scales", "materialize_rest",
    "pack_int4", "plan_clip", "publish", "publish_int4", "publish_int8", "qmax", "quant_layers",
    "quantizable_layers", "quantize_groups", "quantize_model", "read_published", "save_quantized",
    "save_scales", "tensors_checksum", "unpack_int4",
]
