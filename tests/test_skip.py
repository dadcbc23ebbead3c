"""Skip masks (``engine/model/skip.py``): round trips, and one-line errors for masks that cannot be."""
import pytest

from knnssd.engine.model.skip import MaskError, SkipMask


def test_skip_mask_round_trip_and_errors():
    m = SkipMask.from_layers(6, attn=[1, 4], mlp=[0])
    assert SkipMask.from_json(m.to_json()) == m
    assert SkipMask.from_bits(m.bits, 6) == m
    assert m.n_skipped == 3 and m.fraction == 0.25
    assert str(m) == "attn:010010 mlp:100000"
    with pytest.raises(MaskError, match="needs 12"):
        SkipMask.from_bits([0] * 10, 6)
    with pytest.raises(MaskError, match="for 6 layers; the model has 4"):
        m.validate(4)
    with pytest.raises(MaskError, match="layer 9"):
        SkipMask.from_layers(6, attn=[9])
    with pytest.raises(MaskError, match="not valid JSON"):
        SkipMask.from_json("{nope")
    with pytest.raises(MaskError, match="cannot skip"):
        m.validate(6, can_skip=False)
    # trial 4: 2.7 was read as layer 2, and "6" or true as a count
    for bad, message in (({"n_layers": 6, "skip_attn": [2.7]}, "skip_attn must list layer indices"),
                         ({"n_layers": 6, "skip_mlp": [True]}, "skip_mlp must list layer indices"),
                         ({"n_layers": "6", "skip_attn": [1]}, "n_layers must be an integer"),
                         ({"n_layers": 6, "skip_attn": 3}, "not a skip mask"),
                         ([1, 2, 3], "not a skip mask"),  # trial 5, D1: a traceback
                         ({"n_layers": 6, "skip_mpl": [1]}, "unknown fields \\['skip_mpl'\\]")):  # trial 6
        with pytest.raises(MaskError, match=message):
            SkipMask.from_dict(bad)
