from p2ptrain.averaging.averager import PseudoGradientAverager, RoundResult
from p2ptrain.averaging.compression import COMPRESSIONS, get_compression

__all__ = ["PseudoGradientAverager", "RoundResult", "COMPRESSIONS", "get_compression"]
