"""The calibration steps (``search/steps.py``): the cache key of a search step."""


def test_search_cache_key_reads_the_engine_and_search_sources():
    from knnssd.search import steps
    key = steps.code_version()  # a missing source file fails here, not as a Prefect cache-key log line
    assert len(key) == 16 and key == steps.code_version()
