"""One forward pass: weights, kernels, attention, the KV cache, skip masks, the decoder forms, token-tree
passes, and the exactness probe that proves a verify pass equals one-token steps."""
