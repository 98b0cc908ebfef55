"""A small per-layer state cache for linattn's recurrent layers, shaped after FLA's Cache protocol (the subset its
layers use): `len(cache)`, `cache[layer_idx]` (a dict with "recurrent_state", "conv_state", "offset"),
`cache.update(layer_idx=..., recurrent_state=..., conv_state=..., offset=...)` and `get_seq_length()`."""
from typing import Any, Dict, List, Optional

import torch


class RecurrentCache:
    """The decode states of a stack of recurrent layers, one entry per layer index.

    Entry i holds, for layer i: "recurrent_state" (GatedDeltaNet: fp32 [N, HV, K, V], linattn's layout, where FLA's
    layer stores [N, HV, V, K]), "conv_state" (a tuple of [N, D, W] short-convolution windows, or None) and
    "offset" (the number of tokens seen). A layer's states are replaced by what it returns each call; the
    short-convolution windows of a one-token step are updated in place.
    """

    def __init__(self):
        self.states: List[Optional[Dict[str, Any]]] = []

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, layer_idx: int) -> Dict[str, Any]:
        entry = self.states[layer_idx]
        if entry is None:
            raise KeyError(f"RecurrentCache: layer {layer_idx} has no state yet")
        return entry

    def update(self, layer_idx: int, recurrent_state: Optional[torch.Tensor] = None, conv_state: Any = None,
               offset: int = 1, **_: Any) -> Dict[str, Any]:
        """Store layer `layer_idx`'s new states (None keeps the stored one) and advance its token count."""
        if not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"RecurrentCache.update: layer_idx must be an int >= 0, got {layer_idx!r}")
        while len(self.states) <= layer_idx:
            self.states.append(None)
        entry = self.states[layer_idx]
        if entry is None:
            entry = self.states[layer_idx] = {"recurrent_state": None, "conv_state": None, "offset": 0}
        if recurrent_state is not None:
            entry["recurrent_state"] = recurrent_state
        if conv_state is not None:
            entry["conv_state"] = conv_state
        entry["offset"] += int(offset)
        return entry

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen by layer `layer_idx` (0 before its first update)."""
        if layer_idx >= len(self.states) or self.states[layer_idx] is None:
            return 0
        return self.states[layer_idx]["offset"]
