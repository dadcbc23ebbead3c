"""The MLflow pyfunc server (``serving/pyfunc.py``): its settings checked in one line each, and its
answers strict JSON."""
import json
import math

import pytest


def test_server_settings_are_checked_in_one_line_each():
    """Defects 6, 10 and 13: ``KNNSSD_BATCH_SIZE=abc``, ``KNNSSD_DTYPE=float16`` and ``KNNSSD_DEVICE=cuda``
    gave tracebacks of 100-147 lines, and ``KNNSSD_BATCH_SIZE=0`` (which the CLI rejects) was taken."""
    import torch

    from knnssd.serving.pyfunc import server_settings

    cases = [({"KNNSSD_BATCH_SIZE": "abc"}, "KNNSSD_BATCH_SIZE must be 'auto' or an integer >= 1, got 'abc'"),
             ({"KNNSSD_BATCH_SIZE": "0"}, "got '0'"), ({"KNNSSD_BATCH_SIZE": "-3"}, "got '-3'"),
             ({"KNNSSD_DTYPE": "float16"}, "KNNSSD_DTYPE='float16' is not one of auto, bfloat16, float32"),
             ({"KNNSSD_DEVICE": "gpu0"}, "KNNSSD_DEVICE: unknown device 'gpu0'"),
             ({"KNNSSD_GRAPHS": "1"}, "KNNSSD_GRAPHS='1' is not one of auto, on, off")]
    if not torch.cuda.is_available():
        cases.append(({"KNNSSD_DEVICE": "cuda"}, "KNNSSD_DEVICE: device 'cuda' asked for, but CUDA is not available"))
    for env, message in cases:
        with pytest.raises(ValueError) as e:
            server_settings(env)
        assert message in str(e.value) and "\n" not in str(e.value), env
    assert server_settings({"KNNSSD_DTYPE": "", "KNNSSD_BATCH_SIZE": " 4 "}) == {
        "model": None, "dtype": "auto", "device": "auto", "slots": 4}


def test_the_scoring_servers_variable_is_where_mlflow_sets_it():
    """``pyfunc._refuse`` knows it runs under ``mlflow models serve`` by the variable MLflow's scoring server
    sets (a private name): this fails loudly when the pinned MLflow renames it."""
    from mlflow.pyfunc import scoring_server

    assert scoring_server._SERVER_MODEL_PATH == "__pyfunc_model_path__"


def test_server_answers_are_strict_json():
    """Defect 3: a request mixing a prompt no anchor matches with one that matches got ``"cluster": NaN``
    and clusters as floats (``3.0``), which JSON.parse rejects."""
    import io

    import numpy as np
    from mlflow.pyfunc.scoring_server import predictions_to_json

    from knnssd.engine.spec.loop import DecodeStats
    from knnssd.serving.pyfunc import frame
    from knnssd.serving.routed import Result

    def result(cluster, similarity):
        return Result("t", [1], cluster, "l", similarity, "plain AR", DecodeStats(), 0.0, 0.1, 3, False, np.zeros(2))

    out = io.StringIO()
    predictions_to_json(frame([result(None, 0.1), result(3, 0.9), result(None, math.nan)]), out)

    def strict(token):
        raise ValueError(f"not JSON: {token}")

    rows = json.loads(out.getvalue(), parse_constant=strict)["predictions"]
    assert [r["cluster"] for r in rows] == [None, 3, None] and isinstance(rows[1]["cluster"], int)
    assert rows[2]["similarity"] is None
