"""The decoding engine: weights as plain tensors (stack), the static KV cache, attention forms and
the exactness probe, skip masks and the lean forward (skip), sampling, drafters and the
speculative loop (decode). It imports nothing else from knnssd but the base
layer's settings (native.py: the folder its library is built into)."""
