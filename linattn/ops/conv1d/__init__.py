"""The depthwise causal convolution (FLA's short convolution) and its decode step."""
from linattn.ops.conv1d.api import causal_conv1d
from linattn.ops.conv1d.update import causal_conv1d_update, causal_conv1d_update3

__all__ = ["causal_conv1d", "causal_conv1d_update", "causal_conv1d_update3"]
