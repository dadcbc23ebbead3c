"""The decoding engine, in four rooms, each importing only the rooms before it:

- ``model``: one forward pass. The weights as plain tensors (``weights``), int8 and GGUF copies
  (``quantized``), the C kernels (``native``), attention forms, the KV cache, skip masks, the decoder
  forms and their interface (``forms``), token-tree passes (``tree``), the exactness probe, and what a
  pass costs here.
- ``spec``: speculative decoding of one sequence. A request's settings (``request_params``), the
  drafters and their draft-length policy, the suffix tree, verification by sampling, and the loop.
- ``batch``: many sequences at once. The scheduler, the batch's plan, the batch's draft lengths, and
  prompt-prefix reuse.
- ``static``: the fixed-shape step for devices that replay captured graphs, its runner, and its slots.

It imports nothing else from knnssd but the base layer's settings (``model.native``: the folder its
library is built into)."""
