"""Units of `knnssd serve` (no model): text handed out token by token, stop strings, and the OpenAI
request shapes."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from knnssd.engine.spec.request_params import GenerateParams
from knnssd.serving.openai_protocol import ApiError, ChatRequest, CompletionRequest
from knnssd.serving.text_stream import TextStream, stop_cut


class Bytes:
    """A byte-level tokenizer: token i is byte i, as GPT-2-style BPE's tokens are byte strings."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def pieces(text: str, stops=(), sizes=(1,)) -> tuple[list[str], TextStream]:
    """What a stream hands out for ``text`` arriving ``sizes`` bytes a step, ending, as the engine does,
    with the step whose tokens complete a stop string."""
    data, s, out, i, n = list(text.encode()), TextStream(Bytes(), stops), [], 0, 0
    while i < len(data) and not any(stop in s._decode() for stop in stops):
        k = sizes[n % len(sizes)]
        out.append(s.feed(data[i:i + k]))
        i, n = i + k, n + 1
    out.append(s.finish())
    return out, s


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from("ab é€😀\n,"), max_size=30), st.lists(st.integers(1, 5), min_size=1, max_size=4),
       st.lists(st.text(alphabet="ab é€,", min_size=1, max_size=3), max_size=2))
def test_streamed_pieces_join_into_the_whole_text_and_never_split_a_character(text, sizes, stops):
    got, s = pieces(text, tuple(stops), tuple(sizes))
    assert "".join(got) == s.text == stop_cut(s._decode(), tuple(stops))[0]
    assert text.startswith(s.text)
    assert not any("\ufffd" in p for p in got)  # no piece ends inside a UTF-8 character
    for stop in stops:  # no character of a stop string was sent before the stream knew
        assert stop not in "".join(got)


def test_a_stop_string_is_held_back_until_it_is_decided():
    got, s = pieces("12, 13, 14, 15", stops=(" 14,",))
    assert "".join(got) == "12, 13," and s.text == "12, 13,"
    got, _ = pieces("ab cd", stops=("cx",))
    assert "".join(got) == "ab cd" and got[-1] == "d"  # "c" waited for the character after it


def test_requests_take_openai_fields_and_name_what_they_do_not_support():
    r = CompletionRequest(model="m", prompt="hi", stop="x", seed=3, max_tokens=5, temperature=0)
    assert r.params(16) == GenerateParams(max_new_tokens=5, temperature=0.0, seed=3, stop=("x",))
    assert CompletionRequest(model="m", prompt="hi").params(16).temperature == 1.0  # OpenAI's default
    assert CompletionRequest(model="m", prompt="hi", n=1, logprobs=None, presence_penalty=0.0).params(16)
    for field, value in (("n", 2), ("logprobs", 3), ("presence_penalty", 0.5), ("tools", [{}]), ("echo", True),
                         ("response_format", {"type": "json_object"})):
        with pytest.raises(ValueError, match=f"'{field}' is not supported"):
            CompletionRequest(model="m", prompt="hi", **{field: value})
    for bad in ({"max_tokens": "5"}, {"temperature": True}, {"stream": "yes"}, {"colour": 1}, {"max_tokens": 0}):
        with pytest.raises(ValueError):
            CompletionRequest(model="m", prompt="hi", **bad)
    with pytest.raises(ApiError, match="one string"):
        CompletionRequest(model="m", prompt=["a", "b"]).text()
    chat = ChatRequest(model="m", messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                       max_completion_tokens=7)
    assert chat.params(1024).max_new_tokens == 7 and chat.messages[0].text() == "hi"
    with pytest.raises(ValueError):
        ChatRequest(model="m", messages=[])


def test_generate_params_take_stop_strings_as_openai_sends_them():
    assert GenerateParams.from_dict({"stop": "x"}).stop == ("x",)
    assert GenerateParams.from_dict({"stop": ["x", "yz"]}).stop == ("x", "yz")
    for bad in ([""], ["x"] * 17, [3], "a" * 300):
        with pytest.raises(ValueError, match="stop must be"):
            GenerateParams.from_dict({"stop": bad})


def test_the_api_keeps_the_whole_prompt_or_refuses_it():
    """``whole_prompt_ids``: a request with no max_tokens gets what the context leaves after its whole prompt
    (a review found the default first cut the prompt to leave room for itself, then refused it as too
    long); one that asks for more than fits, or a prompt over ``max_prompt_tokens``, is ContextTooLong
    naming what to change. Never a prompt's tail."""
    from knnssd.engine.spec.request_params import ContextTooLong, Limits, whole_prompt_ids

    class Words:
        def __call__(self, text):
            return type("Out", (), {"input_ids": list(range(len(text.split())))})()

    limits = Limits(context=100, memory=1 << 30, kv_bytes=1)
    p = GenerateParams(max_new_tokens=64, max_prompt_tokens=80)
    ids, fitted = whole_prompt_ids(Words(), "w " * 70, p, limits, fit=True)
    assert len(ids) == 70 and fitted.max_new_tokens == 30  # the default cut to the room left, the prompt whole
    ids, fitted = whole_prompt_ids(Words(), "w " * 20, p, limits, fit=True)
    assert len(ids) == 20 and fitted.max_new_tokens == 64
    with pytest.raises(ContextTooLong, match="needs 70 tokens of messages and 64 of completion") as e:
        whole_prompt_ids(Words(), "w " * 70, p, limits, fit=False, where="messages")
    assert e.value.param == "max_tokens"
    with pytest.raises(ContextTooLong, match="takes 81 tokens, more than the 80") as e:
        whole_prompt_ids(Words(), "w " * 81, p, limits, fit=True)
    assert e.value.param == "prompt"
    with pytest.raises(ContextTooLong, match="needs 100 tokens of prompt and 1 of completion") as e:
        whole_prompt_ids(Words(), "w " * 100, GenerateParams(max_prompt_tokens=200), limits, fit=True)
    assert e.value.param == "prompt"


def test_api_keys_from_flags_the_environment_and_a_file_admit_only_a_bearer_of_one(tmp_path):
    from knnssd.serving.access import ENV, Keys

    f = tmp_path / "keys"
    f.write_text("# rotated on the 1st\nsk-new\n\n  sk-old  \n")
    keys = Keys.gather(["sk-flag"], str(f), {ENV: "sk-env"})
    assert len(keys.digests) == 4 and keys
    for good in ("Bearer sk-flag", "bearer sk-env", "Bearer sk-new", "Bearer  sk-old "):
        assert keys.admits(good), good
    for bad in (None, "", "Bearer", "Bearer sk-ne", "Basic sk-new", "sk-new", "Bearer sk-new2"):
        assert not keys.admits(bad), bad
    assert not Keys.gather([], None, {}) and not Keys().admits("Bearer x")
    for given, file, message in ((["a b"], None, "no spaces"), ([""], None, "one word")):
        with pytest.raises(ValueError, match=message):
            Keys.gather(given, file, {})
    (tmp_path / "empty").write_text("# nothing\n\n")
    for name, message in (("empty", "holds no key"), ("nosuch", "cannot read it")):
        with pytest.raises(ValueError, match=message):
            Keys.gather([], str(tmp_path / name), {})


def test_only_loopback_binds_go_without_a_key():
    from knnssd.serving.access import Keys, bind_error, loopback

    assert all(map(loopback, ("127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost")))
    assert not any(map(loopback, ("0.0.0.0", "::", "10.0.0.5", "example.com", "")))
    assert bind_error("127.0.0.1", Keys(), False) is None and bind_error("0.0.0.0", Keys(), True) is None
    assert bind_error("0.0.0.0", Keys.gather(["k"], None, {}), False) is None
    assert "--api-key" in bind_error("0.0.0.0", Keys(), False)


@pytest.mark.parametrize("path, client, header, metrics_open, passes", [
    ("/v1/completions", ("127.0.0.1", 1), None, False, False),
    ("/v1/completions", ("127.0.0.1", 1), b"Bearer k", False, True),
    ("/v1/models", ("127.0.0.1", 1), b"Bearer no", False, False),
    ("/health", ("10.0.0.5", 1), None, False, True),
    ("/metrics", ("127.0.0.1", 1), None, False, True),
    ("/metrics", ("10.0.0.5", 1), None, False, False),
    ("/metrics", ("10.0.0.5", 1), b"Bearer k", False, True),
    ("/metrics", ("10.0.0.5", 1), None, True, True),
])
def test_the_key_guards_v1_everywhere_and_metrics_beyond_loopback(path, client, header, metrics_open, passes):
    import asyncio

    from knnssd.serving.access import Keys, RequireKey

    reached, refused = [], []

    async def inner(scope, receive, send):
        reached.append(scope["path"])

    def refuse(missing):
        async def answer(scope, receive, send):
            refused.append(missing)
        return answer

    scope = {"type": "http", "path": path, "client": client,
             "headers": [(b"authorization", header)] if header is not None else []}
    asyncio.run(RequireKey(inner, Keys.gather(["k"], None, {}), refuse, metrics_open)(scope, None, None))
    assert (reached, refused) == (([path], []) if passes else ([], [header is None]))


def test_quotas_cap_each_keys_running_requests_and_tokens_a_minute():
    """Issue 68, point 3: per key, a request past ``concurrent`` running, or past ``tokens_per_minute`` in
    the last 60 s (charged ``max_tokens`` on admission, then what it used), is refused with the whole seconds
    until it would pass; another key is not held back, and a lease ends once."""
    from knnssd.serving.quota import Caps, OverCap, Quotas

    now = [1000.0]
    q = Quotas(Caps(concurrent=2, tokens_per_minute=100), clock=lambda: now[0])
    a1, a2 = q.take("key 1", 30), q.take("key 1", 30)
    with pytest.raises(OverCap, match="has 2 requests running") as e:
        q.take("key 1", 1)
    assert (e.value.retry_after_s, e.value.kind) == (1, "requests")
    q.take("key 2", 100).end(100)  # its own cap
    a1.end(10)
    a1.end(10)  # once: not a second place freed
    assert q.running["key 1"] == 1
    now[0] += 20
    with pytest.raises(OverCap, match="used 40 of its 100 tokens a minute") as e:
        q.take("key 1", 70)
    assert (e.value.retry_after_s, e.value.kind) == (40, "tokens")  # a1's 10 leave the window 40 s on
    with pytest.raises(OverCap, match="more than this API key's 100 tokens a minute") as e:
        q.take("key 1", 101)
    a2.end(0)
    q.take("key 1", 90)  # a2 settled at 0: 10 + 90 fit
    now[0] += 61
    assert q.take("key 1", 100)  # the window has moved past them all
    assert not Caps() and Caps(concurrent=1)


class _Gate:
    """A batch observer that holds the batch's thread at each step until ``open``."""

    def __init__(self):
        import threading

        self.event = threading.Event()

    def step(self, *args) -> None:
        self.event.wait(60)


@pytest.fixture
def tiny_server():
    """``create_app`` over a tiny model's batch of 2 slots, with keys "sk-a" and "sk-b" capped at one request
    running and 60 tokens a minute each, at most 6 open connections and 2 s for a request's head or a pause in
    its body, in uvicorn on a thread with the server's protocol; and the gate on its batch."""
    import socket
    import threading
    import time

    import uvicorn

    from knnssd.engine.spec.drafters import DrafterConfig
    from knnssd.reachable import free_port
    from knnssd.serving import openai_server
    from knnssd.serving.access import Keys
    from knnssd.serving.batcher import Batcher, serving_plan
    from knnssd.serving.connections import with_head_deadline
    from knnssd.serving.metrics import ServerMetrics
    from knnssd.serving.quota import Caps
    from knnssd.serving.routed import RoutedGenerator
    from knnssd.serving.serve_config import ServeConfig
    from test_graphed_generation import bank, loaded

    def load():
        gen = RoutedGenerator(loaded(), bank([DrafterConfig(kind="ngram", max_len=4)]))
        return gen, serving_plan(gen, 2, "--batch-size", True, 128)

    batcher = Batcher(load, max_len=128)
    gate = _Gate()
    batcher.observer = gate
    counted: set = set()
    app = openai_server.create_app(batcher, ServerMetrics(), ServeConfig(
        "/banks/tiny", request_timeout_s=60.0, keys=Keys.gather(["sk-a", "sk-b"], None, {}),
        caps=Caps(concurrent=1, tokens_per_minute=60), max_connections=6, head_timeout_s=2.0), connections=counted)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning",
                                           http=with_head_deadline(2.0, counted)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", gate
    finally:
        gate.event.set()
        server.should_exit = True
        thread.join(30)
        batcher.close()


def test_a_key_past_its_caps_gets_429_with_retry_after_and_others_go_on(tiny_server):
    """Issue 68, point 3, through HTTP: with key A's one request held in the batch, its second gets 429
    (``requests``, Retry-After 1) in OpenAI's shape while key B's is taken; past A's 60 tokens a minute, 429
    (``tokens``) with the seconds until its charges leave the window; a stream whose client left before
    its first byte frees A's place. The 429s come before the request takes a slot."""
    import json
    import socket
    import time
    import urllib.error
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    url, gate = tiny_server
    prompt = " ".join(str(3 + i) for i in range(6))

    def post(key: str, max_tokens: int, stream: bool = False):
        req = urllib.request.Request(f"{url}/v1/completions", json.dumps(
            {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}).encode(),
            {"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.read(), r.headers
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), e.headers

    with ThreadPoolExecutor(2) as pool:
        held = pool.submit(post, "sk-a", 8)
        time.sleep(0.5)  # A's request is in the batch, held at its first step
        code, body, headers = post("sk-a", 8)
        assert code == 429 and headers["Retry-After"] == "1", body
        assert body["error"]["type"] == "requests" and body["error"]["code"] == "rate_limit_exceeded"
        assert "its cap (--key-concurrency 1)" in body["error"]["message"]
        other = pool.submit(post, "sk-b", 8)  # another key: admitted, and waits for the gate as A's does
        time.sleep(0.5)
        assert not other.done()
        gate.event.set()
        assert held.result()[0] == 200 and other.result()[0] == 200
    code, body, headers = post("sk-a", 50)  # 6 + 8 used, 50 more asked: over 60
    assert code == 429 and body["error"]["type"] == "tokens" and 1 <= int(headers["Retry-After"]) <= 60, body
    code, body, _ = post("sk-a", 61)
    assert code == 429 and "set max_tokens lower" in body["error"]["message"], body
    gate.event.clear()
    raw = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8, "stream": True}).encode()
    sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
                 b"Bearer sk-a\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw)
    sock.close()  # gone before its first byte
    gate.event.set()
    deadline = time.monotonic() + 20
    while (code := post("sk-a", 4)[0]) == 429 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert code == 200


def test_a_json_body_is_read_as_json_whatever_its_content_type(tiny_server):
    """Trial 6, D1: a valid JSON body sent without ``Content-Type: application/json`` (as ``curl -d`` sends it, a
    form) got 400 "the body must be a JSON object"; malformed JSON without the header got the same line."""
    import json
    import urllib.error
    import urllib.request

    url, gate = tiny_server
    gate.event.set()
    body = json.dumps({"model": "tiny", "prompt": "3 4 5", "max_tokens": 2, "temperature": 0}).encode()
    for kind, data, status, said in (("application/x-www-form-urlencoded", body, 200, None),  # curl -d's
                                     ("text/plain", body, 200, None),
                                     ("text/plain", b'{"model": "tiny", "prompt": ', 400, "the body is not valid JSON")):
        req = urllib.request.Request(f"{url}/v1/completions", data, {"Authorization": "Bearer sk-b",
                                                                     "Content-Type": kind})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                got, answer = r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            got, answer = e.code, json.loads(e.read())
        assert got == status, (kind, answer)
        assert said is None or said in answer["error"]["message"], (kind, answer)


def test_a_request_past_the_open_connections_cap_gets_503_in_openai_shape(tiny_server):
    """Trial 6, D3: past ``--max-connections`` uvicorn answered a plain-text 503, without Retry-After and not
    counted in /metrics. With 6 connections held open (the cap), another's request gets OpenAI's 503 with
    Retry-After, counted; once they close, requests are answered again."""
    import json
    import socket
    import time
    import urllib.error
    import urllib.request

    url, gate = tiny_server
    gate.event.set()
    port = int(url.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(6)]
    time.sleep(0.3)  # each counted as the server takes it
    try:
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"{url}/v1/models", timeout=30)
        body = json.loads(e.value.read())["error"]
        assert e.value.code == 503 and e.value.headers["Retry-After"] == "1", body
        assert body["type"] == "server_busy" and "(--max-connections 6)" in body["message"], body
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.3)
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as r:
        assert 'knnssd_requests_total{status="503"} 1.0' in r.read().decode()


def test_a_champion_watch_says_a_failure_once_until_it_changes(caplog):
    """Trial 6: an alias moved to a version without a bank logged the same warning at every --reload-s."""
    import threading

    from knnssd.serving.champion import ChampionWatch

    watch = ChampionWatch(None, "models:/m@champion", None, 0.01)
    errors = iter(["no bank", "no bank", "no bank", "registry down", "registry down"])
    done = threading.Event()

    def poll():
        try:
            raise RuntimeError(next(errors))
        except StopIteration:
            done.set()
            watch._stop.set()

    watch.poll = poll
    with caplog.at_level("WARNING", logger="knnssd.serving.champion"):
        watch.start()
        assert done.wait(10)
        watch.stop()
    said = [r.getMessage() for r in caplog.records if "could not check" in r.getMessage()]
    assert len(said) == 2 and "no bank" in said[0] and "registry down" in said[1], said


def test_a_body_that_stops_arriving_gets_408_and_no_schema_is_served(tiny_server):
    """Trial 6: a request whose body fell short of its Content-Length held its connection for as long as the
    client liked (the head's deadline ends with the head); now a pause of ``--head-timeout`` in the body gets
    408 in OpenAI's shape. And ``/openapi.json`` answered without a key: the server has no routes beyond the
    API's."""
    import json
    import socket
    import time
    import urllib.error
    import urllib.request

    url, gate = tiny_server
    gate.event.set()
    sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30)
    t0 = time.monotonic()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: Bearer sk-a\r\nContent-Length: 1000\r\n\r\n{\"model\": ")
    got = b""
    while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        got += chunk
    sock.close()
    assert got.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 15, got[:300]
    assert json.loads(got.split(b"\r\n\r\n", 1)[1])["error"]["type"] == "timeout"
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{url}/openapi.json", timeout=30)
    assert e.value.code == 404
