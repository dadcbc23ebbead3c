"""The static step: fixed row buckets a device can capture as graphs, one sequence on it
(``graphs.StaticDecoder``), and a batch's slots on it (``slots``)."""
