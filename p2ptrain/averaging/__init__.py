from p2ptrain.averaging.averager import PseudoGradientAverager, RoundResult
from p2ptrain.averaging.compression import COMPRESSIONS, get_compression
from p2ptrain.hivemind_compat import step_controls_outside_fake_mode

step_controls_outside_fake_mode()

__all__ = ["PseudoGradientAverager", "RoundResult", "COMPRESSIONS", "get_compression"]
