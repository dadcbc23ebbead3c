"""Many sequences in one pass: the scheduler, the batch's plan and its checks, the batch's draft lengths
(goodput), and prompt-prefix reuse."""
