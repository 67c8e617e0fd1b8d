"""HF <-> Megatron checkpoint conversion (CLI: `mcore-rl-convert`, see docs/convert.md)."""

from mcore_rl.convert.common import ConvertError
from mcore_rl.convert.hf_to_mcore import hf_to_mcore
from mcore_rl.convert.mcore_to_hf import mcore_to_hf
from mcore_rl.convert.verify import VerifyResult, verify

__all__ = ["ConvertError", "VerifyResult", "hf_to_mcore", "mcore_to_hf", "verify"]
