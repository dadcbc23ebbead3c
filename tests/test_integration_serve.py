"""`knnssd serve`, the OpenAI-compatible server, through the real `openai` client and raw HTTP: streams
equal whole answers and `knnssd generate`, concurrency, exact cuts and counts, disconnects, a full
queue, timeouts, hostile requests and SIGTERM. (The live champion swap is in test_integration_extend,
beside the add-domain and promote it needs.)"""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pyarrow.parquet as pq
import pytest

from cli_cases import run_cli
from knnssd.processes import group_members
from servers import KnnssdServer as Server
from test_integration_generate import cli_env, registered  # noqa: F401 - the module's fixture

pytestmark = pytest.mark.integration
MODEL = "knnssd-smollm2"  # the id `knnssd serve` gives the champion of knnssd-smollm2
COUNTING = "Count from 1 to 500: 1, 2, 3, 4, 5, 6, 7, 8,"
KEY = "sk-test-7f3a9c1e"  # the module's server asks for it: every request of these tests sends it  # the n-gram drafter accepts long blocks of it


@pytest.fixture(scope="module")
def server(registered, tmp_path_factory):  # noqa: F811
    s = Server(registered["uri"], tmp_path_factory.mktemp("serve"), "--max-queue", "64", "--head-timeout", "2", key=KEY)
    yield s
    s.stop()


def mixed_prompts(data_dir: Path, n: int) -> list[str]:
    domains = ("reasoning", "translation", "text_to_sql", "storytelling", "summarization")
    rows = {d: [json.loads(x)["prompt"] for x in (data_dir / f"{d}.jsonl").read_text().splitlines() if '"eval"' in x]
            for d in domains}
    return [rows[domains[i % len(domains)]][i // len(domains)] for i in range(n)]


def streamed(client, **kw) -> tuple[str, list, object]:
    """The text of a streamed completion, its chunks, and the last chunk with choices."""
    text, chunks, last = "", [], None
    for ch in client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        chunks.append(ch)
        if ch.choices:
            text += ch.choices[0].text
            last = ch
    return text, chunks, last


def test_streams_equal_whole_answers_and_knnssd_generate(server, registered, data_dir, tmp_path,  # noqa: F811
                                                         prefect_api):
    """12 mixed eval prompts, greedy: each streamed text equals the whole answer, and both equal
    `knnssd generate`'s text for the prompt (where the server's batch is exact); usage agrees."""
    prompts = mixed_prompts(data_dir, 12)
    whole = [server.client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0) for p in prompts]
    for p, w in zip(prompts, whole):
        text, chunks, last = streamed(server.client, model=MODEL, prompt=p, max_tokens=24, temperature=0)
        assert text == w.choices[0].text and last.choices[0].finish_reason == w.choices[0].finish_reason
        assert chunks[-1].usage.completion_tokens == w.usage.completion_tokens <= 24
        assert w.choices[0].model_extra["knnssd"]["steps"] >= 1
    inp = tmp_path / "p.jsonl"
    inp.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    out = tmp_path / "o.parquet"
    run = subprocess.run([sys.executable, "-m", "knnssd.cli", "generate", "--model-uri", f"models:/{MODEL}@champion",
                          "--input", str(inp), "--output", str(out), "--max-new-tokens", "24"],
                         env=cli_env(registered, {**os.environ, **prefect_api}),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    generated = {r["id"]: r for r in pq.read_table(out).to_pylist()}
    if server.info()["knnssd"]["exact"]:
        assert [generated[f"p{i}"]["text"] for i in range(12)] == [w.choices[0].text for w in whole]
        assert [generated[f"p{i}"]["new_tokens"] for i in range(12)] == [w.usage.completion_tokens for w in whole]


def test_32_concurrent_streams_equal_their_answers_alone(server, data_dir):
    prompts = mixed_prompts(data_dir, 16) * 2
    alone = [server.client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text
             for p in prompts[:16]] * 2
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(lambda p: streamed(server.client, model=MODEL, prompt=p, max_tokens=12,
                                                    temperature=0)[0], prompts))
    if server.info()["knnssd"]["exact"]:
        assert together == alone


def test_blocks_are_cut_at_max_tokens_stop_strings_and_eos(server):
    """The n-gram drafter accepts blocks of several tokens on a counting prompt; a block that crosses
    ``max_tokens`` or a stop string is cut there, in the text and in the usage, and a chat answer that
    ends with EOS counts its tokens up to it, never past."""
    c = server.client
    long = c.completions.create(model=MODEL, prompt=COUNTING, max_tokens=40, temperature=0)
    texts = {}
    multi = blocks = False
    for k in range(1, 41):
        text, chunks, last = streamed(c, model=MODEL, prompt=COUNTING, max_tokens=k, temperature=0)
        assert chunks[-1].usage.completion_tokens == k and last.choices[0].finish_reason == "length"
        assert long.choices[0].text.startswith(text)
        texts[k] = text
        multi |= len([ch for ch in chunks if ch.choices]) < k  # a chunk carried several tokens
        # whether a stream drafts is the goodput rule's choice, from timings and acceptance that change as the
        # server runs: on a busy machine the first request once drafted and the 40 streams did not
        blocks |= last.choices[0].model_extra["knnssd"]["accepted"] > 0
    assert multi or not blocks  # where a stream's drafts were accepted, a chunk carried several tokens, cut exactly
    stop = " 17,"
    cut = long.choices[0].text[: long.choices[0].text.index(stop)]
    k = min(k for k, t in texts.items() if stop in t)  # the token that completes the stop string is the last
    for stream in (False, True):
        if stream:
            text, chunks, last = streamed(c, model=MODEL, prompt=COUNTING, max_tokens=40, temperature=0, stop=[stop])
            finish, used = last.choices[0].finish_reason, chunks[-1].usage.completion_tokens
        else:
            r = c.completions.create(model=MODEL, prompt=COUNTING, max_tokens=40, temperature=0, stop=stop)
            text, finish, used = r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
        assert (text, finish, used) == (cut, "stop", k), stream
    ask = lambda n: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is 2+2?"}],  # noqa: E731
                                              max_tokens=n, temperature=0)
    eos = ask(200)
    n = eos.usage.completion_tokens
    assert eos.choices[0].finish_reason == "stop" and n < 200
    again = ask(n)  # exactly enough: the same answer, ended by EOS
    assert (again.choices[0].message.content, again.choices[0].finish_reason, again.usage.completion_tokens) == (
        eos.choices[0].message.content, "stop", n)
    short = ask(n - 1)
    assert short.choices[0].finish_reason == "length" and short.usage.completion_tokens == n - 1


def test_hostile_requests_get_a_4xx_in_openai_shape(server):
    bad = [
        (b'{"model": "knnssd-smollm2", "prompt": ', 400, "not valid JSON"),
        (b"[1, 2]", 400, "valid dictionary"),
        ({"model": MODEL}, 400, "'prompt' is required"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ({"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 10**9}, 400, "of completion, more than the model's context"),
        # a prompt that did not fit with max_tokens was cut to its last tokens and answered 200 (a hostile trial)
        ({"model": MODEL, "prompt": "Please translate this long sentence about the weather in Paris:",
          "max_tokens": 8190}, 400, "shorten the prompt or ask for fewer tokens"),
        ({"model": MODEL, "prompt": "hello " * 5000}, 400, "more than the 4096 a prompt may take here"),
        ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "hi", "temperature": 1e308}, 400, "temperature"),
        ({"model": MODEL, "prompt": "hi", "seed": 2**70}, 400, "seed must be in"),
        ({"model": MODEL, "prompt": "hi", "frobnicate": 1}, 400, "unknown field 'frobnicate'"),
        ({"model": MODEL, "prompt": "hi", "n": 2}, 400, "'n' is not supported"),
        ({"model": MODEL, "prompt": "hi", "logprobs": 5}, 400, "'logprobs' is not supported"),
        ({"model": MODEL, "prompt": ["a", "b"]}, 400, "must be one string"),
        ({"model": MODEL, "prompt": [1, 2, 3]}, 400, "prompt"),
        ({"model": MODEL, "prompt": "hi", "stop": "\ud800"}, 400, "stop is not valid UTF-8"),  # was accepted
        ({"model": MODEL, "prompt": "   "}, 400, "empty prompt"),
        ({"model": MODEL, "prompt": "hi", "stop": ["x"] * 20}, 400, "stop must be"),
        ({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}}, 400, "'stream_options' is only"),
        ({"model": "gpt-4", "prompt": "hi"}, 404, "is not served here"),
        (json.dumps({"model": MODEL, "prompt": "x" * (17 << 20)}).encode(), 413, "larger than 16 MiB"),
        (b"", 400, "the body must be a JSON object"),  # trial 5, D8: named 'None'
        (b'{"model": "knnssd-smollm2", "prompt": "hi\xff"}', 400, "error parsing the body"),  # D7: not OpenAI's shape
    ]
    chat = [
        ({"model": MODEL, "messages": []}, 400, "messages"),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
        ({"model": MODEL, "messages": [{"role": "user"}]}, 400, "content"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400,
         "'tools' is not supported"),
        ({"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "content parts"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 8190}, 400,
         "tokens of messages and 8190 of completion"),
        # trial 6, D2: named the parameter 'prompt' (null), which a chat request does not have
        ({"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages are not valid UTF-8"),
    ]
    for path, cases in (("/v1/completions", bad), ("/v1/chat/completions", chat)):
        for body, status, message in cases:
            code, answer, _ = server.post(path, body)
            err = answer.get("error", {})
            assert code == status and message in err.get("message", "") and set(err) == {
                "message", "type", "param", "code"}, (body, code, answer)
            assert err["param"] is None or "." not in err["param"] or err["param"].startswith("messages."), err
            if "of completion" in message or "a prompt may take" in message:
                assert err["code"] == "context_length_exceeded" and err["param"] == (
                    "max_tokens" if "max_tokens" in str(body) or "max_completion" in str(body) else "prompt"), err
    # trial 6: a chunked body passed the bound; two pipelined requests got one answer
    big = json.dumps({"model": MODEL, "max_tokens": 2, "prompt": "hello " * (3 << 20)}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(0, len(big), 1 << 20):
            sock.sendall(b"%x\r\n" % len(big[i:i + (1 << 20)]) + big[i:i + (1 << 20)] + b"\r\n")
        sock.sendall(b"0\r\n\r\n")
        assert sock.recv(100).startswith(b"HTTP/1.1 413")
    get = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(get + get)
        got, deadline = b"", time.monotonic() + 10
        while got.count(b"HTTP/1.1 200") < 2 and time.monotonic() < deadline:
            got += sock.recv(65536)
        assert got.count(b"HTTP/1.1 200") == 2
    for method, path, status in (("GET", "/v1/completions", 405), ("GET", "/v1/nothing", 404)):  # D7
        with pytest.raises(urllib.error.HTTPError) as e:  # a 2xx would not raise: it fails the test
            urllib.request.urlopen(urllib.request.Request(server.url + path, method=method, headers=server.headers),
                                   timeout=30)
        assert e.value.code == status and set(json.loads(e.value.read())["error"]) == {
            "message", "type", "param", "code"}
    assert server.client.completions.create(model=MODEL, prompt="Hello", max_tokens=2,
                                            temperature=0).usage.completion_tokens == 2
    with urllib.request.urlopen(urllib.request.Request(server.url + "/health", method="HEAD"), timeout=30) as r:
        assert r.status == 200 and r.read() == b""  # trial 5 found HEAD a 405
    # the client's models.retrieve (trial 5 found GET /v1/models/<id> a 404)
    assert [m.id for m in server.client.models.list()] == [MODEL] and server.client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        server.client.models.retrieve("gpt-4")
    seeded = server.client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0.7, seed=-1)
    assert 1 <= seeded.usage.completion_tokens <= 2  # D6: -1 is a random seed, as the message and the CLI say
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as r:
        text = r.read().decode()
    for name in ("knnssd_requests_total", "knnssd_prompt_tokens_total", "knnssd_completion_tokens_total",
                 "knnssd_drafted_tokens_total", "knnssd_accepted_tokens_total", "knnssd_steps_total",
                 "knnssd_queue_depth", "knnssd_active_slots", "knnssd_step_seconds_bucket",
                 "knnssd_time_to_first_token_seconds_bucket", "knnssd_inter_token_latency_seconds_bucket",
                 'knnssd_served_info{bank_version="1"'):
        assert name in text, name
    assert 'knnssd_requests_total{status="400"}' in text


def test_a_keyed_server_answers_401_without_its_key_and_never_shows_it(server):
    """The module's server asks for ``KEY`` (issue 68): with the real client, no key, a wrong key and the right
    one get 401, 401 and 200, the 401s in OpenAI's shape; streams run with the key; /health and, from
    loopback, /metrics need none; the key is in neither the server's log nor /metrics."""
    bare = urllib.request.Request(server.url + "/v1/completions", json.dumps({"model": MODEL, "prompt": "hi"}).encode(),
                                  {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(bare, timeout=30)
    body = json.loads(e.value.read())["error"]
    assert e.value.code == 401 and e.value.headers["WWW-Authenticate"] == "Bearer"
    assert set(body) == {"message", "type", "param", "code"} and "no API key given" in body["message"]
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0, timeout=60)
    for call in (lambda c: c.completions.create(model=MODEL, prompt="hi", max_tokens=2), lambda c: c.models.list()):
        with pytest.raises(openai.AuthenticationError) as e:
            call(wrong)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    ok = server.client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    text, _, last = streamed(server.client, model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert text == ok.choices[0].text and last.choices[0].finish_reason == ok.choices[0].finish_reason
    with urllib.request.urlopen(f"{server.url}/health", timeout=30) as r:
        assert r.status == 200
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as r:
        metrics = r.read().decode()
    assert 'knnssd_requests_total{status="401"}' in metrics and KEY not in metrics
    assert KEY not in server.log_path.read_text()


def test_clients_that_trickle_their_request_heads_are_closed_while_others_are_answered(server):
    """uvicorn closes no connection whose request head is still arriving: in a hostile trial, 200 clients sending
    header bytes at 1 byte/s held their sockets for 70 s. With ``--head-timeout 2`` each of 8 such clients, sending
    a header line every 0.3 s, is closed within 15 s, and /health is answered meanwhile."""
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=15) for _ in range(8)]
    for sock in socks:
        sock.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
    open_, deadline = set(range(len(socks))), time.monotonic() + 15
    while open_ and time.monotonic() < deadline:
        for i in list(open_):
            try:
                socks[i].sendall(b"X-Slow: 1\r\n")
            except OSError:  # closed by the server: a reset or a broken pipe
                open_.discard(i)
        time.sleep(0.3)
        with urllib.request.urlopen(f"{server.url}/health", timeout=30) as r:
            assert r.status == 200
    for sock in socks:
        sock.close()
    assert not open_, f"{len(open_)} of {len(socks)} trickling connections still open after 15 s"


def test_16_streams_whose_clients_leave_mid_answer_are_counted_499_and_free_their_slots(server):
    """Trial 6 saw /metrics count 15 of 16 clients that left mid-stream as ``status="200"``. 16 streams of up to
    2,000 tokens, each closed by its client after its first event: all 16 are counted 499, none 200, and
    every slot and queue place is free again."""
    was = {s: metric(server, f'knnssd_requests_total{{status="{s}"}}') for s in ("200", "499")}
    raw = json.dumps({"model": MODEL, "prompt": COUNTING, "max_tokens": 2000, "temperature": 0, "stream": True,
                      "stop": "zzzz"}).encode()
    socks = []
    for _ in range(16):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=120)
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(raw) + raw)
        socks.append(sock)
    for sock in socks:  # each stream's first event: its sequence is in a slot and has begun
        got = b""
        while b"data: " not in got:
            chunk = sock.recv(65536)
            assert chunk, got
            got += chunk
        assert got.startswith(b"HTTP/1.1 200"), got[:200]
    for sock in socks:
        sock.close()
    until_gauge(server, "knnssd_active_slots", 0)
    until_gauge(server, "knnssd_queue_depth", 0)
    deadline = time.monotonic() + 60  # a sequence leaves at its next step, and is counted as its handler ends
    while metric(server, 'knnssd_requests_total{status="499"}') < was["499"] + 16 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(server, 'knnssd_requests_total{status="499"}') == was["499"] + 16
    assert metric(server, 'knnssd_requests_total{status="200"}') == was["200"]


def until_gauge(s: Server, name: str, value: float, within_s: float = 60) -> None:
    """Wait for the server's /metrics to show ``name`` at ``value`` (a fixed sleep lost the race on a busy
    machine)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"{s.url}/metrics", timeout=30) as r:
            if f"{name} {float(value)}" in r.read().decode().splitlines():
                return
        time.sleep(0.05)
    raise AssertionError(f"{name} never reached {value}")


def metric(s: Server, sample: str) -> float:
    """One sample of the server's /metrics, such as ``knnssd_requests_total{status="499"}`` (0 if absent)."""
    with urllib.request.urlopen(f"{s.url}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[-1])
    return 0.0


def made(s: Server) -> float:
    """Tokens the server has made so far: each step of one sequence makes one beyond those it accepted."""
    return metric(s, "knnssd_accepted_tokens_total") + metric(s, "knnssd_steps_total")


def left_early(s: Server, was: float, gone: int) -> None:
    """The sequence whose client went away left its slot at once. Counted, not timed: a bound on the next
    request's wall time failed on a loaded machine, where the server's steps were slow, not its slot late.
    Run to its end or its timeout, the sequence would be counted 200 or 504, not 499, and make hundreds
    of tokens."""
    assert metric(s, 'knnssd_requests_total{status="499"}') == gone
    assert made(s) - was < 500


def test_one_slot_server_frees_disconnects_refuses_a_full_queue_and_times_out(registered, tmp_path):  # noqa: F811
    """One slot, a queue of one, 8 s per request: a stream closed by its client leaves the slot at once;
    a third request while one runs and one waits gets 503 with Retry-After; a request past its time is
    cancelled with 504; SIGTERM with a stream in flight ends the server with status 0, leaving nothing.
    And ``--max-model-len``: a request over it gets 400, and the model card says it."""
    s = Server(registered["uri"], tmp_path, "--batch-size", "1", "--max-queue", "1", "--request-timeout", "8",
               "--grace-s", "2", "--max-model-len", "7000")
    try:
        c = s.client
        assert c.models.retrieve(MODEL).model_extra["max_model_len"] == 7000
        code, answer, _ = s.post("/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 7000})
        assert code == 400 and answer["error"]["code"] == "context_length_exceeded", answer
        assert "more than the server's --max-model-len of 7000 tokens" in answer["error"]["message"], answer
        # Greedy, and compared with the same request before any client left: the sequence a client leaves must
        # not reach the next one in its slot. (Sampled at OpenAI's default temperature 1, this request once made
        # 3 tokens, not 4: "Hello" is followed by EOS often enough for that to be chance, not a leak.)
        hello = c.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
        assert hello.usage.completion_tokens == 4 and hello.choices[0].finish_reason == "length"
        stream = c.completions.create(model=MODEL, prompt=COUNTING, max_tokens=2000, temperature=0, stream=True)
        next(iter(stream))
        was = made(s)
        stream.close()  # the client goes away
        assert c.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0).choices[0].text == \
            hello.choices[0].text
        left_early(s, was, 1)  # not behind the 2000 tokens of the closed stream

        # long enough to outlast the 8 s timeout however fast the drafts are (2000 tokens once took less)
        body = {"model": MODEL, "prompt": COUNTING.replace("500", "5000"), "max_tokens": 6000, "temperature": 0}
        with ThreadPoolExecutor(2) as pool:
            t0 = time.monotonic()
            running = pool.submit(s.post, "/v1/completions", body)  # holds the slot
            until_gauge(s, "knnssd_active_slots", 1)
            # The timeout counts from arrival, queue included: sent at once, the waiting request had only the
            # gauge's poll to spare when the slot came free, and on a loaded machine it timed out too. Half the
            # timeout is room.
            time.sleep(max(0.0, t0 + 4 - time.monotonic()))
            waiting = pool.submit(s.post, "/v1/completions", {**body, "max_tokens": 4})
            until_gauge(s, "knnssd_queue_depth", 1)
            code, answer, headers = s.post("/v1/completions", {**body, "max_tokens": 4})
            assert code == 503 and answer["error"]["type"] == "server_busy" and headers.get("retry-after") == "1"
            code, answer, _ = running.result()
            assert code == 504 and answer["error"]["type"] == "timeout", answer
            assert waiting.result()[0] == 200

        # trial 5, D4: a whole-answer client that disconnects freed its slot only at the end of its answer
        sock = socket.create_connection(("127.0.0.1", s.port))
        raw = json.dumps({**body, "stop": ["zzzz"]}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(raw) + raw)
        until_gauge(s, "knnssd_active_slots", 1)
        was = made(s)
        sock.close()
        assert c.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0).choices[0].text == \
            hello.choices[0].text
        left_early(s, was, 2)  # not held to its 8 s timeout, which would have answered 504

        # trial 5, D5: past the grace period a stream was cut mid-text, and uvicorn logged a traceback
        stream = urllib.request.urlopen(urllib.request.Request(
            f"{s.url}/v1/completions", json.dumps({**body, "stream": True, "stop": "zzzz"}).encode(),
            {"Content-Type": "application/json"}), timeout=120)
        stream.readline()
    finally:
        code = s.stop()
    assert code == 0, s.log_path.read_text()[-3000:]
    assert not group_members(s.proc.pid)
    events = [x for x in stream.read().decode().splitlines() if x.strip()]
    assert events[-1] == "data: [DONE]" and json.loads(events[-2][6:])["error"]["type"] == "server_shutdown"
    assert "Traceback" not in s.log_path.read_text()


def test_serve_refuses_what_cannot_work_in_one_line(registered, tmp_path):  # noqa: F811
    """Before the model loads: a port it cannot take, counts and seconds out of range, an unknown alias,
    a dtype it does not know, more slots than the KV budget holds (the pyfunc server's ``KNNSSD_*``
    settings ended in MLflow's own traceback: trial 4, D10)."""
    env = {**os.environ, "MLFLOW_TRACKING_URI": registered["uri"], "KNNSSD_WORK": str(tmp_path / "work")}
    uri = ["serve", "--model-uri", f"models:/{MODEL}@champion"]
    cases = [([*uri, "--port", "99999"], "cannot serve there"),
             ([*uri, "--batch-size", "0"], "--batch-size must be 'auto' or an integer >= 1"),
             ([*uri, "--max-queue", "0"], "--max-queue must be an integer >= 1"),
             ([*uri, "--request-timeout", "nan"], "--request-timeout must be a number of seconds > 0"),
             (["serve", "--model-uri", f"models:/{MODEL}@nosuch"], "nosuch"),
             ([*uri, "--dtype", "float16"], "invalid choice: 'float16'"),
             ([*uri, "--batch-size", "100000"], "--batch-size"),
             ([*uri, "--max-model-len", "1"], "--max-model-len must be an integer from 2 to 8192 (the model's "
                                                "context of 8192 tokens), got 1"),
             ([*uri, "--max-model-len", "9000"], "--max-model-len must be an integer from 2 to 8192"),
             # a bind that lets other machines in, with no key: refused before the model loads (issue 68)
             ([*uri, "--host", "0.0.0.0"], "--host 0.0.0.0 lets other machines in, and no API key is set: give "
                                           "--api-key"),
             ([*uri, "--api-key-file", str(tmp_path / "nosuch")], "--api-key-file"),
             (["ui", "--host", "0.0.0.0"], "give --insecure-no-auth")]
    for (args, message), res in zip(cases, run_cli([args for args, _ in cases], env)):
        assert res.code == 2 and len(res.stderr) == 1 and message in res.stderr[0], (args, res)
