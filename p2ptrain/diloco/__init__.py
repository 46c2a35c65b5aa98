"""DiLoCo as one drop-in optimizer: an inner optimizer every step, an averaged outer step every ``local_steps``.

One sync (an "outer step"), on every peer:

1. pseudo-gradient = (global parameters at the last sync) - (current parameters), fp32 on CPU
2. average it with the peers that are ready (``PseudoGradientAverager``), each weighted by the samples it trained on
   since the last sync; fp16 on the wire by default (or none, bf16, int8), fp32 accumulation; bit-identical result
   on every peer. With error feedback (int8 by default), the peer adds what the wire dropped of its previous
   pseudo-gradient to this one first
3. outer optimizer (SGD + Nesterov) steps on the fp32 global copy, with the average as its gradient
4. the model's parameters become the new global parameters; the inner optimizer's state carries over

Since every peer of a group starts a round with the same global parameters and outer state and receives the same
bits, every peer leaves it with the same bits too: no parameter-averaging round is ever needed on top.
"""

from p2ptrain.diloco.optimizer import DiLoCoOptimizer
from p2ptrain.diloco.options import DiLoCoOptions
from p2ptrain.diloco.records import NO_GROUP_POLICIES, RoundOutlook, SyncRecord, _digest_of

__all__ = ["DiLoCoOptimizer", "DiLoCoOptions", "NO_GROUP_POLICIES", "RoundOutlook", "SyncRecord", "_digest_of"]
