"""p2ptrain: DiLoCo training over a hivemind DHT."""

__version__ = "0.1.0"

from p2ptrain.diloco import DiLoCoOptimizer, SyncRecord  # noqa: E402

__all__ = ["DiLoCoOptimizer", "SyncRecord", "__version__"]
