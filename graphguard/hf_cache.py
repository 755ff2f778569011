"""The static cache GraphedCausalLM decodes over: transformers' StaticCache, with the updates
that keep Python-side state made holes of the captured step.

A full-attention layer (`StaticLayer`) writes its keys and values at a device counter and
advances that counter in place: tensor ops a graph replays. A sliding-window layer
(`StaticSlidingWindowLayer`) also keeps a Python int beside the counter, chooses by it whether
to write at the counter or to roll its window, and answers the mask's sizes from it: a graph
would replay the branch and the int of its capture forever. Its update is therefore a hole
(graphguard/core/holes.py): it runs eagerly at every replay, between the graphs before and after
it, so the int advances and the branch is chosen as in eager. Both branches of a one-token step
return the layer's own keys and values tensors, which the graph after the hole reads in place.
The masks are built outside the step from that int, as `generate` builds them
(GraphedCausalLM passes them in).

Any other layer type (offloaded, quantized, a layer of another library) is a hole too: only a
plain StaticLayer is known to keep nothing outside its tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from graphguard.core.holes import hole


class HoledStaticCache(StaticCache):
    """A StaticCache whose layers with Python-side state update in holes (module docstring)."""

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        if type(self.layers[layer_idx]) is StaticLayer:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        return hole(self._update, key_states, value_states, layer_idx, *args, **kwargs)

    def _update(self, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return super().update(*args, **kwargs)

    @property
    def num_holes(self) -> int:
        """How many of its layers update in a hole."""
        return sum(type(layer) is not StaticLayer for layer in self.layers)
