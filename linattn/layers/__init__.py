"""nn.Module layers on linattn's ops, with FLA 0.6's constructors and state-dict names."""
from linattn.layers.cache import RecurrentCache
from linattn.layers.conv import ShortConvolution
from linattn.layers.gated_deltanet import GatedDeltaNet
from linattn.layers.kda import KimiDeltaAttention
from linattn.layers.norm import FusedRMSNormGated
from linattn.layers.rmsnorm import RMSNorm

__all__ = ["GatedDeltaNet", "KimiDeltaAttention", "RecurrentCache", "ShortConvolution", "FusedRMSNormGated",
           "RMSNorm"]
