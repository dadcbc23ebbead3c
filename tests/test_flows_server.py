"""The Prefect server the flows run on (``flows/server.py``): one that does not answer fails in seconds."""
import pytest

from cli_cases import Stopwatch


def test_prefect_api_that_does_not_answer_fails_in_seconds():
    from knnssd.flows.server import PrefectUnavailable, check

    watch = Stopwatch()
    with pytest.raises(PrefectUnavailable, match="does not answer"):
        check("http://127.0.0.1:9/api")
    assert watch.seconds() < 15
