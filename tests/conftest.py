import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

# Two test processes share the two cores: OpenMP threads that spin while they wait take the cores the
# other process needs (docs/benchmarks.md, 2026-11-28). Set before torch loads; servers, workers and
# CLIs the tests start inherit it. How threads wait changes no result (``exactness.WAIT_ENV``).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import torch  # noqa: E402
from hypothesis import HealthCheck, settings

sys.path.insert(0, str(Path(__file__).parent))
from servers import PrefectServer  # noqa: E402

for key, value in {
    "HF_HUB_OFFLINE": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "true",
    "MLFLOW_DISABLE_TELEMETRY": "true", "TOKENIZERS_PARALLELISM": "false",
}.items():
    os.environ.setdefault(key, value)

# Property tests: 200 examples in CI; KNNSSD_EXAMPLES=1000 (and pytest --hypothesis-seed=N) for more.
# Libraries leave files in the temp folder (MLflow a `db_init_lock-*` per sqlite database, Prefect's
# runners `runner_storage/`), and each test makes its own database: the session, and every process it
# starts, gets a temp folder of its own, removed at the end.
TMP = tempfile.mkdtemp(prefix="knnssd-tests-")
os.environ["TMPDIR"] = TMP
tempfile.tempdir = None  # gettempdir() reads TMPDIR again


def pytest_unconfigure(config):
    shutil.rmtree(TMP, ignore_errors=True)


settings.register_profile(
    "knnssd", max_examples=int(os.environ.get("KNNSSD_EXAMPLES", "200")), deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], derandomize=False,
)
settings.load_profile("knnssd")
torch.set_num_threads(min(2, torch.get_num_threads()))
THREADS = torch.get_num_threads()

DATA = Path(os.environ.get("KNNSSD_DATA", Path(__file__).resolve().parents[2] / "shared" / "data"))


@pytest.fixture(autouse=True)
def threads(request):
    """Tests of the real model run on two threads (this machine's cores); tests of tiny random models on
    one: their calls are too small to share, and one thread runs them in about 2/3 of the time."""
    n = min(2, THREADS) if request.node.get_closest_marker("integration") else 1
    torch.set_num_threads(n)
    yield n
    torch.set_num_threads(THREADS)


@pytest.fixture(autouse=True)
def native_kernels_kept():
    """A test that changes how the native kernels load must leave them loadable: a None it left in
    ``native_library.library``'s cache ran every later test of the session on torch ops, unseen."""
    from knnssd.engine.model import native_library

    cached = native_library.library.cache_info().currsize
    before = native_library.library() is not None if cached else None
    yield
    if before and native_library.library.cache_info().currsize and native_library.library() is None:
        native_library.library.cache_clear()
        pytest.fail("the test left native_library.library() None: clear its cache after the last call that may fail")


@pytest.fixture(scope="session")
def data_dir() -> Path:
    if not (DATA / "reasoning.jsonl").is_file():
        pytest.skip(f"prompt sets not found at {DATA} (set KNNSSD_DATA)")
    return DATA


def flow_dtype() -> str:
    """The precision the flow tests run the real model in (calibrate, add-domain, watch, generate, serve): bf16
    where knnssd's native bf16 step runs (each row alone by construction; on an AVX2-only Zen 3 it decoded
    several times fp32's tokens/s, docs/benchmarks.md), else fp32. Tests of fp32 itself, or against HF's own
    forward, name float32."""
    from knnssd.engine.model import native_library

    return "bfloat16" if native_library.kernel_path() != "torch" else "float32"


FLOW_DTYPE = flow_dtype()


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded model, fp32 (converted once into the knnssd cache): the one copy that flows
    called in this process also use (``steps.runtime``), so the session loads it once."""
    from knnssd.search import steps
    return steps.runtime(steps.ModelSpec("smollm2", "float32"))[0]


_prefect: PrefectServer | None = None  # the session's Prefect server, started at collection when needed
_prefect_wanted = False  # on an xdist worker: started with the worker's first integration test instead
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
_misplaced: set[str] = set()  # tests whose integration mark and file name disagree


def _integration_file(nodeid: str) -> bool:
    """Whether a test is in an integration file (``test_integration_*.py``), where its mark must agree.
    `make test` (``-n 2 --dist loadfile``) gives each worker whole files: a file's module fixtures (a
    registered bank, a server) are made in one worker only."""
    return Path(nodeid.split("::")[0]).name.startswith("test_integration_")


# Seconds each file took (``--junitxml``, summed by file) in `make test` on the slowest kind drawn, a 2-core
# Zen 3 (docs/benchmarks.md, "2026-12-07, late night"). `make test` hands whole files to its two
# workers longest first (``--no-loadscope-reorder`` keeps this order; xdist's own puts the files with the most
# tests first, which left the five longest files, of one to three tests each, to the end). A file not listed
# goes after those listed.
FILE_SECONDS: dict[str, float] = {
    "test_integration_shards.py": 457, "test_integration_generate.py": 353, "test_integration_extend.py": 247,
    "test_integration_serve.py": 236, "test_integration_engine.py": 183, "test_sampling.py": 151,
    "test_integration_calibrate.py": 131, "test_integration_bench.py": 110, "test_integration_exact.py": 85,
    "test_integration_planted.py": 79, "test_cli.py": 61, "test_exact_step.py": 54, "test_batched.py": 51,
    "test_static_step.py": 37, "test_exactness.py": 35, "test_search.py": 28, "test_gpu_check.py": 26,
    "test_integration_processes.py": 25, "test_tree.py": 20, "test_device_step.py": 18, "test_native_isa.py": 18,
}


def _by_length(items) -> None:
    """Reorder ``items`` (in place) file by file, longest first; a file's tests keep their order."""
    first = {}
    for i, item in enumerate(items):
        first.setdefault(item.nodeid.split("::")[0], i)
    items.sort(key=lambda item: (-FILE_SECONDS.get(Path(item.nodeid.split("::")[0]).name, 0.0),
                                 first[item.nodeid.split("::")[0]]))


@pytest.hookimpl(trylast=True)  # after -k/-m deselection
def pytest_collection_modifyitems(config, items):
    global _prefect, _prefect_wanted
    _by_length(items)
    for item in items:  # failed when they run (an error raised here is lost in an xdist worker's crash report)
        if (item.get_closest_marker("integration") is not None) != _integration_file(item.nodeid):
            _misplaced.add(item.nodeid)
    if _prefect is None and any("prefect_api" in item.fixturenames for item in items):
        if WORKER is None:
            _prefect = PrefectServer()  # starts now; the first test that needs it waits for it
        else:  # each worker collects every test: only a worker that runs integration tests needs it
            _prefect_wanted = True


def pytest_runtest_setup(item):
    global _prefect
    if item.nodeid in _misplaced:
        pytest.fail(f"{item.nodeid}: integration tests, and only they, go in test_integration_*.py", pytrace=False)
    if _integration_file(item.nodeid) and _prefect_wanted and _prefect is None:
        _prefect = PrefectServer()  # overlaps the first integration tests, which do not need it


def pytest_terminal_summary(terminalreporter):
    """The machine beside the suite's time (the next line): the suite is bounded on every machine kind, and
    each run of it, CI's included, then measures the kind it ran on."""
    terminalreporter.write_line(f"machine: {_machine()}")


def _machine() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return f"{platform.machine()}, {os.cpu_count()} cores"
    info = dict(line.split(":", 1) for line in lines if ":" in line)
    info = {k.strip(): v.strip() for k, v in info.items()}
    flags = set(info.get("flags", "").split())
    bf16 = " ".join(f for f in ("avx512_bf16", "amx_bf16") if f in flags) or "no avx512_bf16"
    return (f"{info.get('model name', platform.processor() or platform.machine())}, family {info.get('cpu family', '?')} "
            f"model {info.get('model', '?')}, {os.cpu_count()} cores, {bf16}")


def pytest_sessionfinish(session, exitstatus):
    if _prefect is not None:
        _prefect.stop()


@pytest.fixture(scope="session")
def prefect_api() -> dict:
    """One real `prefect server` on 127.0.0.1 for the session (``servers.PrefectServer``), its
    database migrated once, not by every command. Returns the environment that points a subprocess
    at it (``{**os.environ, **prefect_api}``): CLI commands then check it instead of starting a
    temporary server of their own."""
    global _prefect
    if _prefect is None:
        _prefect = PrefectServer()
    return _prefect.env()


@pytest.fixture(scope="session")
def prefect_harness(prefect_api):
    """Flows called in this process run against the session's Prefect server."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from knnssd.flows.server import drain

    with temporary_settings(updates={PREFECT_API_URL: prefect_api["PREFECT_API_URL"]}):
        yield
        drain()
