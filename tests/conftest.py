import os
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))

for key, value in {
    "HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true", "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(key, value)

# Property tests: 200 examples in CI; KNNSSD_EXAMPLES=1000 (and pytest --hypothesis-seed=N) for more.
settings.register_profile(
    "knnssd", max_examples=int(os.environ.get("KNNSSD_EXAMPLES", "200")), deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], derandomize=False,
)
settings.load_profile("knnssd")
torch.set_num_threads(min(2, torch.get_num_threads()))

DATA = Path(os.environ.get("KNNSSD_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not (DATA / "reasoning.jsonl").is_file():
        pytest.skip(f"prompt sets not found at {DATA} (set KNNSSD_DATA)")
    return DATA


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded model, fp32 (converted once into the knnssd cache)."""
    from knnssd import models

    return models.load("smollm2", dtype="float32")


@pytest.fixture(scope="session")
def prefect_harness():
    """A throwaway Prefect API for the session (flows run against it, not a server of the user's)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield
