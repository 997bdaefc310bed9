"""greenroom: actor offload and optimizer-state streaming for colocated RL."""

from greenroom.config import OffloadConfig, add_arguments

__version__ = "0.1.0"
__all__ = ["OffloadConfig", "add_arguments", "__version__"]
