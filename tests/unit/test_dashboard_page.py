"""The dashboard's HTTP server and its page: the server's routes over real HTTP on 127.0.0.1 port 0, and the page
rendered by headless Chromium against a fixture swarm, checked on the DOM its scripts built."""

from __future__ import annotations

import http.client
import json
import logging
import math
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from html.parser import HTMLParser
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from p2ptrain.observe.dashboard import DashboardServer
from tests.browser import find_chromium, render

pytestmark = pytest.mark.timeout(120)

PEERS = [
    "12D3KooWLiU1mcVp3SUtMxnBXWwbBPzSgfBXBzPsbvbUeH5MXnNA",
    "12D3KooWRqBFS9P4cUwZv1HjJ3a2pyKzgbEKtR8bvCHXumcWT8Gm",
    "12D3KooWDy8b7jPkPz6hETv5Q3RWm2T7FpK9XqAWWnLbT4TNzvSQ",
]
STALE = PEERS[2]


def swarm_fixture(now: float) -> dict:
    """Three peers, the third stale: 20 training-loss samples and 3 evals each, 9 rounds (one failed), 2 warnings."""
    losses, evals = {}, {}
    for k, peer in enumerate(PEERS):
        losses[peer] = [[step * 5, 10.5 * math.exp(-step / 12) + 2.6 + 0.05 * k + 0.03 * math.sin(step), now - 200 + step]
                        for step in range(20)]
        evals[peer] = [[outer * 30, 6.0 * math.exp(-outer / 2) + 2.8 + 0.05 * k, now - 150 + outer * 40]
                       for outer in range(1, 4)]
    rounds = []
    for outer in range(1, 4):
        for k, peer in enumerate(PEERS):
            failed = (outer, k) == (2, 1)
            rounds.append(dict(peer_id=peer, outer_step=outer, finished_at=now - 150 + outer * 40 + k * 0.7,
                               group_size=1 if failed else 3, seconds=0.6 + 0.1 * outer + 0.05 * k,
                               matchmaking_s=0.2, allreduce_s=0.4, bytes_sent=0 if failed else 876_000 + 1000 * k,
                               bytes_received=0 if failed else 876_000, averaged=not failed))
    peers = []
    for k, peer in enumerate(PEERS):
        last = [r for r in rounds if r["peer_id"] == peer][-1]
        peers.append(dict(
            peer_id=peer, mode="public" if k < 2 else "client", reachability="public: /ip4/127.0.0.1/tcp/4100"
            if k < 2 else "private: relayed", outer_step=3, local_step=95 + k, samples_per_s=41.5 - 3 * k,
            tokens_per_s=2656.0 - 192 * k, last_seen=now - (45 if peer == STALE else 1.5), stale=peer == STALE,
            shard=4 + k, shard_passes=0.37, data_position=[0, 1234 + k], loss=losses[peer][-1][1],
            eval_loss=evals[peer][-1][1], banned=[PEERS[2]] if k == 0 else [],
            last_sync={key: last[key] for key in ("outer_step", "finished_at", "group_size", "seconds", "bytes_sent",
                                                  "bytes_received", "averaged")}))
    return dict(
        run_id="demo", updated_at=now - 1, private=False, public_peers=2, peers=peers, losses=losses, evals=evals,
        rounds=rounds, coverage=dict(fraction_seen=0.4, shards_complete=2, num_shards=16, passes=0),
        warnings=[dict(kind="stale_peer", peer_id=STALE, message=f"peer ...{STALE[-8:]} last seen 45 s ago"),
                  dict(kind="banned_peer", peer_id=PEERS[0], message=f"peer ...{PEERS[0][-8:]} banned ...{STALE[-8:]}")])


def empty_swarm(now: float) -> dict:
    return dict(run_id="demo", updated_at=now, private=True, public_peers=0, peers=[], losses={}, evals={}, rounds=[],
                coverage=None, warnings=[dict(kind="no_peers", peer_id=None, message="no peer has published yet")])


@pytest.fixture
def serve():
    """``serve(snapshot, **kwargs)`` -> a started DashboardServer on a free port, closed after the test."""
    servers: List[DashboardServer] = []

    def start(snapshot, **kwargs) -> DashboardServer:
        servers.append(DashboardServer(snapshot, port=0, **kwargs).start())
        return servers[-1]

    yield start
    for server in servers:
        server.close()


# ---------------------------------------------------------------- the DOM, parsed with the standard library

class Node:
    def __init__(self, tag: str, attrs: Dict[str, Optional[str]], parent: Optional["Node"]):
        self.tag, self.attrs, self.parent = tag, attrs, parent
        self.children: List[object] = []  # Nodes and str
        self.raw = ""  # the serialized DOM, on the root

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def classes(self) -> set:
        return set((self.attrs.get("class") or "").split())

    def walk(self):
        for child in self.children:
            if isinstance(child, Node):
                yield child
                yield from child.walk()

    def find_all(self, tag: Optional[str] = None, cls: str = "") -> List["Node"]:
        want = set(cls.split())
        return [n for n in self.walk() if (tag is None or n.tag == tag) and want <= n.classes()]

    def by_id(self, id_: str) -> "Node":
        found = [n for n in self.walk() if n.attrs.get("id") == id_]
        assert len(found) == 1, f"{len(found)} elements with id {id_!r}"
        return found[0]

    @property
    def hidden(self) -> bool:
        return "hidden" in self.attrs


class DomParser(HTMLParser):
    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.root = self.current = Node("#document", {}, None)

    def handle_starttag(self, tag, attrs):
        node = Node(tag, dict(attrs), self.current)
        self.current.children.append(node)
        if tag not in self.VOID:
            self.current = node

    def handle_endtag(self, tag):
        node = self.current
        while node is not None and node.tag != tag:
            node = node.parent
        if node is not None and node.parent is not None:
            self.current = node.parent

    def handle_data(self, data):
        self.current.children.append(data)


def parse(dom: str) -> Node:
    parser = DomParser()
    parser.feed(dom)
    parser.close()
    return parser.root


def needs_chromium() -> None:
    if find_chromium() is None:
        pytest.skip("chromium is not installed: apt-get install chromium (Debian) to run the dashboard's browser tests")


def render_page(url: str, **kwargs) -> Node:
    """The page's DOM after its scripts ran, failing on any uncaught error or console.error in the page."""
    console: List[str] = []
    dom = render(url, console=console, **kwargs)
    errors = [m for m in console if "Uncaught" in m or "Error" in m]
    assert not errors, f"the page logged errors: {errors}"
    tree = parse(dom)
    tree.raw = dom
    return tree


# ---------------------------------------------------------------- the page in a browser

def test_the_page_draws_a_three_peer_swarm(serve):
    needs_chromium()
    now = time.time()
    swarm = swarm_fixture(now)
    server = serve(lambda: swarm)
    artifacts = Path(os.environ.get("P2PTRAIN_TEST_ARTIFACTS", "/tmp/p2ptrain-test-artifacts"))
    shot = artifacts / "dashboard.png"
    shot.unlink(missing_ok=True)
    page = render_page(server.url, screenshot=shot, window=(1400, 1300))

    assert page.by_id("run-id").text() == "demo"
    assert page.by_id("peer-count").text() == "3"
    assert page.by_id("swarm-kind").text() == "open swarm" and not page.by_id("swarm-kind").hidden
    assert page.by_id("updated").text().startswith("updated ") and page.by_id("updated").text().endswith(" s ago")
    assert page.by_id("error").hidden

    rows = page.by_id("peers").find_all("tr", "peer")
    assert [r.attrs["data-peer-id"] for r in rows] == PEERS
    assert [("stale" in r.classes()) for r in rows] == [False, False, True]
    first = rows[0].find_all("td")
    assert first[0].text().startswith(PEERS[0][-8:]) and first[0].attrs["title"] == PEERS[0]
    assert "shard 4" in first[7].text() and "0/1234" in first[7].text()
    assert "group 3" in first[6].text() and "0.88 MB sent" in first[6].text()
    assert page.by_id("peers-empty").hidden

    chart = page.by_id("loss-chart")
    train = [p for p in chart.find_all("path", "series") if "eval" not in p.classes()]
    assert sorted(p.attrs["data-peer-id"] for p in train) == sorted(PEERS)
    assert all(p.attrs["d"].startswith("M") and p.attrs["d"].count("L") == 19 for p in train)
    evals = chart.find_all("path", "series eval")
    assert sorted(p.attrs["data-peer-id"] for p in evals) == sorted(PEERS) and all(p.attrs["d"] for p in evals)
    assert chart.find_all("text", "y-tick") and chart.find_all("text", "x-tick")
    # one colour per peer, the same in the loss chart, the rounds charts and the table's swatches
    colours = {p.attrs["data-peer-id"]: p.attrs["stroke"] for p in train}
    assert len(set(colours.values())) == 3
    for row in rows:
        rgb = re.search(r"rgb\((\d+), (\d+), (\d+)\)", row.find_all("span", "swatch")[0].attrs["style"]).groups()
        assert "#" + "".join(f"{int(c):02x}" for c in rgb) == colours[row.attrs["data-peer-id"]]

    rounds_chart = page.by_id("rounds-chart")
    marks = rounds_chart.find_all("circle", "round")
    assert len(marks) == 9 * 3
    for panel in ("rounds-seconds", "rounds-group", "rounds-bytes"):
        in_panel = page.by_id(panel).find_all("circle", "round")
        assert len(in_panel) == 9 and len([m for m in in_panel if "failed" in m.classes()]) == 1
        assert all(m.attrs["stroke"] == colours[m.attrs["data-peer-id"]] for m in in_panel)

    warnings = page.by_id("warnings").find_all("li", "warning")
    assert [w.classes() for w in warnings] == [{"warning", "warning-stale_peer"}, {"warning", "warning-banned_peer"}]
    assert "last seen 45 s ago" in warnings[0].text()
    assert page.by_id("warnings-empty").hidden

    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1400, 1300) and len(data) > 20_000, (width, height, len(data))


def test_an_empty_swarm_says_so(serve):
    needs_chromium()
    server = serve(lambda: empty_swarm(time.time()))
    page = render_page(server.url)
    assert page.by_id("peer-count").text() == "0"
    assert page.by_id("swarm-kind").text() == "private swarm"
    empty = page.by_id("peers-empty")
    assert not empty.hidden and empty.text() == "no live peers in this run yet"
    assert not page.by_id("peers").find_all("tr", "peer")
    assert "no loss samples yet" in page.by_id("loss-chart").text()
    assert not page.by_id("loss-chart").find_all("path")
    assert all("no averaging rounds yet" in page.by_id(p).text()
               for p in ("rounds-seconds", "rounds-group", "rounds-bytes"))
    assert [w.classes() for w in page.by_id("warnings").find_all("li", "warning")] == [{"warning", "warning-no_peers"}]
    assert page.by_id("error").hidden


def test_a_swarm_with_no_warnings_shows_an_empty_state(serve):
    needs_chromium()
    swarm = dict(swarm_fixture(time.time()), warnings=[])
    page = render_page(serve(lambda: swarm).url)
    assert not page.by_id("warnings").find_all("li")
    assert not page.by_id("warnings-empty").hidden and page.by_id("warnings-empty").text() == "no warnings"


def test_nulls_and_single_points_draw_without_errors(serve):
    needs_chromium()
    peer = {key: None for key in swarm_fixture(0)["peers"][0]}
    peer["peer_id"] = PEERS[0]
    swarm = dict(run_id=None, updated_at=None, private=None, public_peers=None, peers=[peer, None, "odd"],
                 losses={PEERS[0]: [[7, 3.5, None]], PEERS[1]: [[1, None, None], "x"], PEERS[2]: None},
                 evals=None, rounds=[None, dict(peer_id=PEERS[0], finished_at=time.time(), seconds=None,
                                                group_size=2, bytes_sent=None, averaged=None)],
                 coverage=None, warnings=[None, dict(kind=None, message=None)])
    page = render_page(serve(lambda: swarm).url)
    assert page.by_id("peer-count").text() == "1" and page.by_id("run-id").text() == "unknown run"
    assert [r.attrs["data-peer-id"] for r in page.by_id("peers").find_all("tr", "peer")] == [PEERS[0]]
    (series,) = page.by_id("loss-chart").find_all("path", "series")
    assert series.attrs["data-peer-id"] == PEERS[0] and series.attrs["d"]
    assert len(page.by_id("loss-chart").find_all("circle", "point")) == 1, "a lone sample is drawn as a dot"
    assert len(page.by_id("rounds-group").find_all("circle", "round")) == 1
    assert not page.by_id("rounds-seconds").find_all("circle") and "not reported" in page.by_id("rounds-seconds").text()
    assert len(page.by_id("warnings").find_all("li", "warning")) == 1
    assert page.by_id("error").hidden


def test_a_snapshot_that_raises_shows_the_error(serve):
    needs_chromium()

    def broken() -> dict:
        raise RuntimeError("the DHT is unreachable\nsecond line")

    page = render_page(serve(broken).url)
    error = page.by_id("error")
    assert not error.hidden
    assert "the DHT is unreachable" in error.text() and "second line" not in error.text()


def test_the_page_keeps_the_last_good_data_when_the_server_fails(serve):
    needs_chromium()
    swarm, calls = swarm_fixture(time.time()), []

    def first_then_fail() -> dict:
        calls.append(1)
        if len(calls) > 1:
            raise TimeoutError("DHT get timed out")
        return swarm

    page = render_page(serve(first_then_fail).url)
    assert len(calls) > 1, "the page polled more than once in its time budget"
    assert not page.by_id("error").hidden and "DHT get timed out" in page.by_id("error").text()
    assert len(page.by_id("peers").find_all("tr", "peer")) == 3
    assert page.by_id("peer-count").text() == "3"


def test_the_page_works_behind_a_reverse_proxy_under_a_path(serve):
    needs_chromium()
    swarm = swarm_fixture(time.time())
    upstream = serve(lambda: swarm).url

    class Prefix(BaseHTTPRequestHandler):
        """/swarm/<path> -> the dashboard's /<path>, as `location /swarm/ { proxy_pass http://dashboard/; }`."""

        def do_GET(self):
            if self.path.startswith("/swarm/"):
                status, headers, body = fetch(upstream + self.path[len("/swarm/"):])
            else:
                status, headers, body = 404, {"Content-Type": "text/plain"}, b"not under /swarm/"
            self.send_response(status)
            self.send_header("Content-Type", headers["Content-Type"])
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    proxy = ThreadingHTTPServer(("127.0.0.1", 0), Prefix)
    thread = threading.Thread(target=proxy.serve_forever, daemon=True)
    thread.start()
    try:
        page = render_page(f"http://127.0.0.1:{proxy.server_address[1]}/swarm/")
    finally:
        proxy.shutdown()
        proxy.server_close()
        thread.join()
    assert page.by_id("peer-count").text() == "3" and page.by_id("error").hidden
    assert len(page.by_id("loss-chart").find_all("path", "series")) == 6


def test_peer_ids_and_messages_are_text_not_markup(serve):
    needs_chromium()
    marker = "data-pwned"
    evil_id = f"12D3KooW<script>document.documentElement.setAttribute('{marker}','1')</script>"
    evil_img = f"<img src=x onerror=\"document.documentElement.setAttribute('{marker}','2')\">"
    swarm = swarm_fixture(time.time())
    swarm["run_id"] = "<b>run</b>"
    swarm["peers"][0]["peer_id"] = evil_id
    swarm["peers"][0]["mode"] = evil_img
    swarm["losses"][evil_id] = swarm["losses"].pop(PEERS[0])
    swarm["rounds"][0]["peer_id"] = evil_id
    swarm["warnings"] = [dict(kind="<i>odd kind</i>", peer_id=evil_id, message=f"banned {evil_id} {evil_img}")]
    page = render_page(serve(lambda: swarm).url)
    assert marker not in page.find_all("html")[0].attrs, "a script from the snapshot ran"
    assert "&lt;script&gt;" in page.raw and "&lt;img src=x" in page.raw
    assert len(page.find_all("script")) == 1, "only the page's own script"
    assert not page.find_all("img") and not page.find_all("b") and not page.find_all("i")
    assert page.by_id("run-id").text() == "<b>run</b>"
    assert page.by_id("peers").find_all("tr", "peer")[0].attrs["data-peer-id"] == evil_id
    assert evil_id in page.by_id("warnings").text()


# ---------------------------------------------------------------- the server, without a browser

def fetch(url: str, method: str = "GET"):
    """(status, headers, body) of one request, also for error statuses."""
    request = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, answer.headers, answer.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def raw_get(server: DashboardServer, path: str) -> int:
    """The status of GET ``path`` sent as is, without a client's normalization of ``..`` or escapes."""
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def test_static_files_and_the_page(serve):
    server = serve(lambda: {})
    for path, content_type, needle in [("", "text/html", b'id="peer-count"'),
                                       ("static/dashboard.js", "text/javascript", b"api/swarm"),
                                       ("static/dashboard.css", "text/css", b"body")]:
        status, headers, body = fetch(server.url + path)
        assert status == 200 and headers["Content-Type"].startswith(content_type) and needle in body
        assert headers["Cache-Control"] == "no-cache" and int(headers["Content-Length"]) == len(body)
        status, head_headers, head_body = fetch(server.url + path, method="HEAD")
        assert status == 200 and head_body == b"" and head_headers["Content-Length"] == str(len(body))
    # the page loads nothing from elsewhere, and nothing by an absolute path (it may sit behind a proxy's prefix)
    refs = re.findall(r'(?:src|href)="([^"]*)"', fetch(server.url)[2].decode())
    assert refs and all(ref.startswith("data:") or not re.match(r"[a-z]+:|/", ref) for ref in refs), refs


@pytest.mark.parametrize("path", ["/static/../server.py", "/static/%2e%2e/server.py", "/static/..%2fserver.py",
                                  "/static/%2Fetc%2Fpasswd", "/static//etc/passwd", "/static/", "/static/.",
                                  "/static/..", "/static/dashboard.js/../../server.py", "/static/__init__.py",
                                  "/../server.py", "/static/%2e%2e%2f__init__.py", "/nope", "/api", "/api/swarm/x"])
def test_traversal_and_unknown_paths_are_404(serve, path):
    server = serve(lambda: {})
    assert raw_get(server, path) == 404


def test_writes_are_405_with_allow(serve):
    server = serve(lambda: {})
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS"):
        status, headers, _ = fetch(server.url + "api/swarm", method=method)
        assert status == 405 and headers["Allow"] == "GET, HEAD", method


def test_api_swarm_is_the_snapshot_as_json(serve):
    swarm = swarm_fixture(time.time())
    swarm["peers"][1]["loss"] = float("nan")  # a diverged peer: null, not a NaN that JSON.parse rejects
    server = serve(lambda: swarm)
    status, headers, body = fetch(server.url + "api/swarm?t=1")
    assert status == 200 and headers["Content-Type"] == "application/json"
    assert headers["Cache-Control"] == "no-store" and abs(float(headers["X-Server-Time"]) - time.time()) < 60
    got = json.loads(body)
    assert got["peers"][1]["loss"] is None
    swarm["peers"][1]["loss"] = None
    assert got == json.loads(json.dumps(swarm))
    assert fetch(server.url + "healthz")[2] == b"ok\n"


def test_a_failing_snapshot_is_a_503_and_one_warning(serve, caplog):
    attempts = []

    def flaky() -> dict:
        attempts.append(1)
        if len(attempts) <= 3:
            raise ConnectionError("no bootstrap peer answered\n  traceback line")
        return {"run_id": "x"}

    server = serve(flaky)
    with caplog.at_level(logging.DEBUG, logger="p2ptrain.observe.dashboard"):
        for _ in range(3):
            status, headers, body = fetch(server.url + "api/swarm")
            assert status == 503 and headers["Content-Type"] == "application/json"
            assert json.loads(body) == {"error": "ConnectionError: no bootstrap peer answered"}
        assert fetch(server.url + "api/swarm")[0] == 200, "the server thread survived"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "no bootstrap peer answered" in warnings[0].getMessage()


def test_api_status(serve):
    assert fetch(serve(lambda: {}).url + "api/status")[0] == 404
    status, _, body = fetch(serve(lambda: {}, status=lambda: {"run_id": "r", "peers": []}).url + "api/status")
    assert status == 200 and json.loads(body) == {"run_id": "r", "peers": []}


def test_requests_are_logged_at_debug_only(serve, capsys, caplog):
    server = serve(lambda: {})
    with caplog.at_level(logging.DEBUG, logger="p2ptrain.observe.dashboard"):
        fetch(server.url + "api/swarm")
        fetch(server.url + "nope")
    assert capsys.readouterr().err == ""
    requests = [r for r in caplog.records if "GET /api/swarm" in r.getMessage()]
    assert requests and all(r.levelno == logging.DEBUG for r in requests)


def test_a_taken_port_raises_oserror():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(OSError):
            DashboardServer(lambda: {}, port=taken.getsockname()[1]).start()
    with DashboardServer(lambda: {}, port=0).start() as first:
        with pytest.raises(OSError):
            DashboardServer(lambda: {}, port=first.port).start()


def test_close_frees_the_port_and_leaves_no_thread():
    threads_before = set(threading.enumerate())
    server = DashboardServer(lambda: {"run_id": "x"}, port=0).start()
    assert server.url == f"http://127.0.0.1:{server.port}/" and server.port > 0
    assert fetch(server.url + "api/swarm")[0] == 200
    server.close()
    server.close()  # idempotent
    deadline = time.monotonic() + 5
    while set(threading.enumerate()) - threads_before and time.monotonic() < deadline:
        time.sleep(0.01)  # a request thread that has sent its answer is finishing
    assert not set(threading.enumerate()) - threads_before
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url + "healthz", timeout=2)
    # the port is free for the next dashboard (a plain bind() could still meet the closed connections' TIME_WAIT)
    with DashboardServer(lambda: {"run_id": "next"}, port=server.port).start() as again:
        assert json.loads(fetch(again.url + "api/swarm")[2]) == {"run_id": "next"}
    DashboardServer(lambda: {}).close()  # never started: nothing to do
