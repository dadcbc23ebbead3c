"""Speculative decoding of one sequence: a request's settings, drafters and their draft-length policy,
the suffix tree, verification (greedy and rejection sampling), and the draft-verify loop."""
