"""Ternary (BitNet b1.58) models and the TerMeZO `ternary` scope.

Importing this package registers the `ternary` scope with `seedfed.shared.scopes`.
"""

from . import scope as _scope  # noqa: F401  (registers the "ternary" scope)
from .bitlinear import BitLinear, bitlinear_modules, convert_to_bitlinear, from_hf_bitlinear
from .errors import TernaryChecksumError, TernaryFormatError
from .io import read_tensors, tensors_checksum, write_tensors
from .mask import SELECTIONS, MaskConfig, choose_mask, mask_size, random_mask, threshold_mask
from .quantize import (
                   GAMMA_FLOOR,
                   absmean_gamma,
    exact_abs_sum,
                   invalid_code_count,
                   pack_ternary,
                   packed_size,
                   quantize_activations,
                   ternarize,
                   threshold_distance,
                   unpack_ternary,
)
from .scope import TernaryScope, build_ternary_scope, start_mask_epoch
from .snapshot import (
                   CODE_MAP,
                   FORMAT,
                   WEIGHTS_FILE,
                   layer_tensors,
                   load_ternary_model,
                   publish_ternary,
                   save_ternary_model,
                   ternary_snapshot,
)

__all__ = [
    "CODE_MAP", "FORMAT", "GAMMA_FLOOR", "SELECTIONS", "WEIGHTS_FILE", "BitLinear",
    "MaskConfig", "TernaryChecksumError", "TernaryFormatError", "TernaryScope",
    "absmean_gamma", "exact_abs_sum", "bitlinear_modules", "build_ternary_scope", "choose_mask",
    "convert_to_bitlinear", "from_hf_bitlinear", "invalid_code_count", "layer_tensors",
    "load_ternary_model", "mask_size", "pack_ternary", "packed_size", "publish_ternary",
    "quantize_activations", "random_mask", "read_tensors", "save_ternary_model",
    "start_mask_epoch", "tensors_checksum", "ternarize", "ternary_snapshot",
    "threshold_distance", "threshold_mask", "unpack_ternary", "write_tensors",
]
