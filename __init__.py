"""specrun: EAGLE speculative decoding for Llama, lowered through the PyTorch compiler."""

__version__ = "0.1.0"
