"""phalanx: train transformers across many devices, with the layout chosen for you."""

__version__ = "0.1.0"
