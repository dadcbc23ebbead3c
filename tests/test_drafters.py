"""Drafters and their settings (``engine/spec/drafters.py``): bad settings refused, a configuration's
round trip, and the n-gram lookup."""
import json
import math

import pytest
import torch

from knnssd.engine.model.skip import MaskError, SkipMask
from knnssd.engine.spec.drafters import DrafterConfig, NGram, build
from knnssd.engine.spec.sampling import Warp
from knnssd.engine.spec.sequence import Sequence


def test_drafter_arguments_are_checked():
    """Defect 13: ``--max-draft -1`` silently turned drafting off; a NaN threshold was taken."""
    for bad, message in ((dict(max_len=-1), "max_len must be an integer >= 1"), (dict(max_len=0), ">= 1"),
                         (dict(threshold=math.nan), r"threshold must be a probability in \[0, 1\], got nan"),
                         (dict(threshold=1.5), "got 1.5"), (dict(threshold=-0.1), "got -0.1"),
                         (dict(ngram_max_len=0), "ngram_max_len"), (dict(ngram_sizes=[]), "ngram_sizes"),
                         (dict(kind="tree"), "unknown drafter kind")):
        with pytest.raises(ValueError, match=message):
            DrafterConfig(**{"kind": "hybrid", **bad})
    DrafterConfig(kind="hybrid", max_len=1, threshold=1.0)


def test_drafter_config_errors():
    with pytest.raises(ValueError, match="unknown drafter kind"):
        DrafterConfig.from_dict({"kind": "magic"})
    with pytest.raises(ValueError, match="unknown drafter fields"):
        DrafterConfig.from_dict({"kind": "ngram", "colour": 1})
    cfg = DrafterConfig(kind="hybrid", mask=SkipMask.from_layers(4, mlp=[3]).to_dict(), threshold=0.5, int8=True)
    assert DrafterConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert "skip 1/8" in cfg.describe()
    with pytest.raises(MaskError):
        build(cfg, 5)


def test_ngram_lookup_uses_latest_match_and_never_itself():
    ng = NGram((2, 1), max_len=3)
    seq = Sequence([5, 6, 7, 8, 5, 6, 9, 5, 6], 9, None, Warp(), None, torch.device("cpu"))
    assert ng.propose(seq, 3).tokens.tolist() == [9, 5, 6]  # latest earlier "5 6" is followed by 9
    seq.tokens.append(1)
    assert ng.propose(seq, 3).tokens.tolist() == []  # "6 1" and "1" never occurred before
    fresh = Sequence([1, 2, 3], 3, None, Warp(), None, torch.device("cpu"))
    assert ng.propose(fresh, 3).tokens.tolist() == []
