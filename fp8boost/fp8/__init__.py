"""The FP8 core: recipes, scaling, backends (emulated / cuBLAS / Triton), Fp8Linear, conversion."""
from .config import Fp8Config
from .convert import (ConversionReport, convert_from_fp8, convert_to_fp8, fp8_layers,
                      is_fp8_layer)
from .linear import Fp8Linear, invalidate_weight_caches
from .recipes import Blockwise, Delayed, Rowwise, ScalingRecipe, Tensorwise
from .record import Fp8Entry, Fp8Record, fp8_entry, fp8_record

__all__ = ["Fp8Config", "Tensorwise", "Delayed", "Rowwise", "Blockwise", "ScalingRecipe",
           "Fp8Linear", "convert_to_fp8", "convert_from_fp8", "ConversionReport",
           "invalidate_weight_caches", "is_fp8_layer", "fp8_layers", "Fp8Entry", "Fp8Record",
           "fp8_entry", "fp8_record"]
