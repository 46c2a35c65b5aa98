"""What a peer's values in a round are held to: finite, and not far larger than our own over the same range.

We are honest, and honest peers' pseudo-gradients over one range are alike in size: a part (or an average) whose L2
norm exceeds ``max_norm_ratio`` x our own values' norm over the same range is refused (``ExactAllReduceRunner``)."""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import torch
from hivemind.averaging.partition import TensorPartContainer

from p2ptrain.finite import all_finite
from p2ptrain.hivemind_compat import own_input_part, own_input_part_shapes


class NormCheck:
    """One round's checks of values against ours. ``own_rms``: what our whole vector holds per value (the reference
    over a range where our own values happen to be small); ``scale_parts``: mixing groups' ``deviation_scale`` over
    each part of each reducer's range (None: not a mixing group)."""

    def __init__(self, max_norm_ratio: Optional[float], own_rms: float,
                 scale_parts: Optional[List[List[torch.Tensor]]] = None) -> None:
        self.max_norm_ratio, self.own_rms, self._scale_parts = max_norm_ratio, own_rms, scale_parts
        self._own_norms: Dict[tuple, float] = {}

    @classmethod
    def of_round(cls, container: TensorPartContainer, max_norm_ratio: Optional[float],
                 deviation_scale: Optional[Sequence[torch.Tensor]] = None) -> "NormCheck":
        """The checks of a round whose local tensors ``container`` cuts into parts."""
        # ... or, for a range where our own values happen to be small (a bias of 2 values whose steps cancelled out),
        # than the ratio times what our whole vector holds per value over that many values: over a few values, two
        # honest peers' norms can differ by any factor, and refusing one split a group (seen in CI)
        local = list(container.local_tensors)
        values = sum(t.numel() for t in local)
        squares = sum(float(torch.linalg.vector_norm(t.float())) ** 2 for t in local)
        own_rms = math.sqrt(squares / values) if values else 0.0
        # mixing groups average stepped states (parameters, momenta), not pseudo-gradients: honest members' values
        # are alike in size there, but a peer must not move them by more than a pseudo-gradient round could. So a
        # value's distance from our own is held to max_norm_ratio x ``deviation_scale`` (our pseudo-gradient, of
        # the same shapes) over the same range: one member shifts a group of n by at most ratio x that / n, the
        # bound of a pseudo-gradient round
        scale_parts = None
        if deviation_scale is not None:
            scale = TensorPartContainer(deviation_scale, container.peer_fractions, container.compression,
                                        part_size_bytes=container.part_size_bytes)
            scale_parts = [[own_input_part(scale, peer, part) for part in range(len(shapes))]
                           for peer, shapes in enumerate(own_input_part_shapes(scale))]
            squares = sum(float(torch.linalg.vector_norm(t.float())) ** 2 for t in deviation_scale)
            own_rms = math.sqrt(squares / values) if values else 0.0
        return cls(max_norm_ratio, own_rms, scale_parts)

    def scale_part(self, peer_index: int, part_index: int) -> Optional[torch.Tensor]:
        """``deviation_scale`` over part ``part_index`` of the range reduced by ``peer_index`` (None without one)."""
        return None if self._scale_parts is None else self._scale_parts[peer_index][part_index]

    def check(self, key: tuple, values: torch.Tensor, own: torch.Tensor, what: str,
              scale: Optional[torch.Tensor] = None) -> str:
        """Why ``values`` (a peer's part, or an average a reducer sent) must not be used: non-finite, or larger
        than ``max_norm_ratio`` times our own values over the same range (or, if larger, times our whole vector's
        RMS over as many values). With ``scale`` (mixing groups): their distance from our own values, against
        ``scale``'s norm instead. Empty if they may. ``key`` names the range: our own norm over it is read once.

        One read of ``values`` in the usual case: their L2 norm is finite only if every value is (a NaN or an
        infinity makes it NaN or infinite); only a non-finite norm (poison, or finite values so large that their
        squares overflow) takes a second read to tell which."""
        norm = float(torch.linalg.vector_norm(values.float()))
        if not math.isfinite(norm) and not all_finite(values):
            return f"{what} with NaN or infinite values"
        if self.max_norm_ratio is None:
            return ""
        if scale is not None:
            norm = float(torch.linalg.vector_norm(values.float() - own.float()))
        if key not in self._own_norms:
            self._own_norms[key] = float(torch.linalg.vector_norm((own if scale is None else scale).float()))
        own_norm = max(self._own_norms[key], self.own_rms * math.sqrt(values.numel()))
        if own_norm > 0 and norm > self.max_norm_ratio * own_norm:
            if scale is not None:
                return (f"{what} at a distance {norm:.4g} from our own values, more than {self.max_norm_ratio:g}x "
                        f"our pseudo-gradient's norm {own_norm:.4g} over the same range")
            return (f"{what} with norm {norm:.4g}, more than {self.max_norm_ratio:g}x our own {own_norm:.4g} over "
                    "the same range")
        return ""
