"""knnssd: lossless, training-free self-speculative decoding for HF decoder-only LLMs (KNN-SSD)."""

__version__ = "0.1.0"
