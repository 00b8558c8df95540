"""Ternary (BitNet b1.58) models and the TerMeZO `ternary` scope.

Importing this package registers the `ternary` scope with `seedfed.shared.model.scopes`.
"""

from seedfed.shared.model.ternary import scope as _scope  # noqa: F401  (registers the "ternary" scope)
from seedfed.shared.model.ternary.bitlinear import (
    BitLinear,
    bitlinear_modules,
    convert_to_bitlinear,
    from_hf_bitlinear,
)
from seedfed.shared.model.ternary.device import (
    build_packed_model,
    load_published_ternary,
    published_state,
)
from seedfed.shared.model.ternary.errors import TernaryChecksumError, TernaryFormatError
from seedfed.shared.model.ternary.io import read_tensors, tensors_checksum, write_tensors
from seedfed.shared.model.ternary.mask import (
    SELECTIONS,
    MaskConfig,
    choose_mask,
    crosses_epoch,
    mask_config,
    mask_size,
    random_mask,
    threshold_mask,
)
from seedfed.shared.model.ternary.quantize import (
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
from seedfed.shared.model.ternary.scope import (
    EPOCH_KEY,
    TernaryScope,
    build_ternary_scope,
    start_mask_epoch,
    version_epoch,
)
from seedfed.shared.model.ternary.snapshot import (
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
    "CODE_MAP", "EPOCH_KEY", "FORMAT", "GAMMA_FLOOR", "SELECTIONS", "WEIGHTS_FILE", "BitLinear",
    "MaskConfig", "TernaryChecksumError", "TernaryFormatError", "TernaryScope",
    "absmean_gamma", "exact_abs_sum", "bitlinear_modules", "build_packed_model",
    "build_ternary_scope", "choose_mask",
    "convert_to_bitlinear", "crosses_epoch", "from_hf_bitlinear", "invalid_code_count",
    "layer_tensors", "load_published_ternary", "load_ternary_model", "mask_config", "mask_size",
    "pack_ternary", "packed_size", "publish_ternary", "published_state",
    "quantize_activations", "random_mask", "read_tensors", "save_ternary_model",
    "start_mask_epoch", "tensors_checksum", "ternarize", "ternary_snapshot",
    "threshold_distance", "threshold_mask", "unpack_ternary", "version_epoch", "write_tensors",
]
