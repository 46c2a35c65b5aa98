"""Bad input to the CLI: one line on stderr that names the problem and the fix, exit code 2, no traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from tests.helpers import p2ptrain

DEAD_PEER = "/ip4/127.0.0.1/tcp/{port}/p2p/QmSXUVsMGJFQBswMvF8D8Fmqy9QgjPzgfoqk3FUZv6ginu"

pytestmark = pytest.mark.timeout(120)


def assert_bad_input(result, *fragments: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["join", "--local-steps", "abc"], ["--local-steps", "not a valid integer"]),
        (["join", "--local-steps", "0"], ["--local-steps"]),
        (["join", "--compression", "int3"], ["--compression", "'int3' is not one of 'none', 'fp16', 'bf16', 'int8'"]),
        (["join", "--reachability", "nat"], ["--reachability", "'nat' is not one of 'auto', 'public', 'client'"]),
        (["join", "--client-mode"], ["--client-mode was removed: use --reachability client"]),
        (["join", "--config", "/nonexistent/run.toml"], ["/nonexistent/run.toml does not exist"]),
        (["join", "--initial-peers", "bootstrap.example.org:4001"], ["--initial-peers", "is not a multiaddr"]),
        (["join", "--initial-peers", "/ip4/127.0.0.1/tcp/4001"], ["has no /p2p/<peer id>"]),
        (["join", "--model", "gigantic"], ["train.model 'gigantic' is unknown", "tiny"]),
        (["join", "--data", "/nonexistent/corpus"], ["/nonexistent/corpus"]),
        (["join", "--nproc-per-node", "3", "--batch-size", "16"], ["--batch-size 16", "multiple of 3"]),
        (["join", "--nproc-per-node", "4", "--shard-size", "3"], ["--shard-size 3", "divisor"]),
        (["join", "--nproc-per-node", "0"], ["--nproc-per-node"]),
        # ~2.3 TiB of activations: refused at start-up with the numbers, before the swarm is joined
        (["join", "--model", "124m", "--batch-size", "100000"], ["needs about", "GiB", "--activation-checkpointing"]),
        (["join", "--nproc-per-node", "2", "--device", "cuda", "--batch-size", "2"], ["needs 2 GPUs", "--device cpu"]),
        (["status"], ["--initial-peers"]),
        # a worker started before its bootstrap peer waits for the file, then says what to fix
        (["join", "--initial-peers-file", "/nonexistent/maddrs", "--bootstrap-timeout", "1"],
         ["--initial-peers-file /nonexistent/maddrs did not appear in 1s", "--maddrs-file"]),
        (["health"], ["--file"]),
        (["bootstrap", "--host-maddrs", "0.0.0.0:4001"], ["--host-maddrs", "is not a multiaddr"]),
        (["frobnicate"], ["No such command"]),
    ],
)
def test_bad_flags(args, fragments):
    assert_bad_input(p2ptrain(*args), *fragments)


@pytest.mark.parametrize("data", ["./nope.txt", "corpus/train.jsonl", "/nonexistent/corpus"])
def test_a_missing_data_file_is_refused_before_the_heavy_imports(data):
    """A file that is not there is refused at once (it took 7.7 s, after torch and hivemind were imported, when
    ``./nope.txt`` passed for a Hugging Face dataset name); owner/name stays a dataset."""
    code = ("import sys\nfrom click.testing import CliRunner\nfrom p2ptrain.cli import cli\n"
            f"result = CliRunner().invoke(cli, ['join', '--data', {data!r}])\n"
            "print(result.exit_code, 'torch' in sys.modules, 'hivemind' in sys.modules, result.output)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert out.startswith("2 False False ") and f"--data {data}: no such file or folder" in out, out


def test_data_path_without_text(tmp_path):
    (tmp_path / "notes.bin").write_bytes(b"\x00" * 10)
    assert_bad_input(p2ptrain("join", "--data", str(tmp_path)), str(tmp_path))


def test_env_var_is_read_and_checked(monkeypatch):
    monkeypatch.setenv("P2PTRAIN_LOCAL_STEPS", "zero")
    assert_bad_input(p2ptrain("join"), "--local-steps")


def test_refused_initial_peer_fails_fast(tmp_path):
    started = time.monotonic()
    result = p2ptrain("join", "--initial-peers", DEAD_PEER.format(port=free_port()), "--bootstrap-timeout", "20",
                      env=dict(TMPDIR=str(tmp_path)))
    assert_bad_input(result, "could not join the swarm", "reachable")
    assert "is closed" not in result.stderr  # asyncio's line about p2pd's exit after its loop closed: noise
    assert time.monotonic() - started < 60
    # the fresh identity key made for this start goes with the failed join (it was left in TMPDIR, mode 0400)
    assert not list(tmp_path.glob("p2ptrain-identity-*")), list(tmp_path.iterdir())


def test_silent_initial_peer_times_out_instead_of_hanging():
    """A host that accepts TCP but never speaks libp2p must give a clear error after --bootstrap-timeout."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    accepted = []
    stop = threading.Event()

    def accept_and_hold():
        server.settimeout(0.5)
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except OSError:
                pass

    thread = threading.Thread(target=accept_and_hold, daemon=True)
    thread.start()
    try:
        result = p2ptrain("join", "--initial-peers", DEAD_PEER.format(port=server.getsockname()[1]),
                          "--bootstrap-timeout", "5", timeout=90)
        assert_bad_input(result, "could not join the swarm")
    finally:
        stop.set()
        thread.join()
        for conn in accepted:
            conn.close()
        server.close()


@pytest.mark.parametrize("command, content, mode, fragment", [
    ("join", None, 0o600, "does not exist; create one with 'p2ptrain keygen"),
    ("join", "ab" * 32 + "\n", 0o644, "chmod 600"),
    ("join", "hello\n", 0o600, "does not hold a swarm key"),
    ("bootstrap", "ab" * 32 + "\n", 0o640, "chmod 600"),
    ("status", "ab" * 31 + "\n", 0o600, "does not hold a swarm key"),
])
def test_bad_swarm_key_files(tmp_path, command, content, mode, fragment):
    key = tmp_path / "swarm.key"
    if content is not None:
        key.write_text(content)
        key.chmod(mode)
    args = [command, "--swarm-key", str(key), "--host-maddrs", "/ip4/127.0.0.1/tcp/0"]
    if command == "status":
        args = [command, "--swarm-key", str(key), "--initial-peers", DEAD_PEER.format(port=free_port())]
    assert_bad_input(p2ptrain(*args, timeout=60), f"--swarm-key {key}", fragment)


def test_keygen_writes_a_key_and_refuses_to_overwrite_it(tmp_path):
    key = tmp_path / "swarm.key"
    done = p2ptrain("keygen", str(key))
    assert done.returncode == 0, done.stderr
    assert f"--swarm-key {key}" in done.stdout and key.stat().st_mode & 0o777 == 0o600
    first = key.read_text()
    assert_bad_input(p2ptrain("keygen", str(key)), "already exists", "never overwrites")
    assert key.read_text() == first  # the run's key is not lost
    assert_bad_input(p2ptrain("keygen", str(tmp_path / "missing" / "swarm.key")), "cannot create", "writable path")


@pytest.mark.slow  # 5 CLI starts with the Hugging Face stack: 30 s the 10-minute default suite cannot spare
@pytest.mark.parametrize("case, fragments", [
    ("folder without config.json", ["has no config.json"]),
    ("hub id, no internet", ["owner/tiny-llama", "cannot be reached"]),
    ("text field not in the data", ["no field 'body'", "(its fields: text, id)", "pass --text-field NAME"]),
    ("tokenizer larger than the embedding", ["has 300 tokens", "256 rows", "vocab_size >= 300"]),
    ("factory returns no module", ["not a torch.nn.Module"]),
])
def test_bad_model_and_data_sources(tmp_path, case, fragments):
    """The user's own model and data (issue 17): each mistake is refused before the swarm is joined."""
    pytest.importorskip("transformers")
    from tests.hf_fixtures import documents, train_tokenizer, write_jsonl

    docs = write_jsonl(tmp_path / "docs.jsonl", documents(40))
    args = {
        "folder without config.json": ["--model", str(tmp_path)],
        "hub id, no internet": ["--model", "owner/tiny-llama"],
        "text field not in the data": ["--data", str(docs), "--text-field", "body"],
        "tokenizer larger than the embedding": ["--data", str(docs),  # the built-in byte model embeds 256 ids
                                                "--tokenizer", str(train_tokenizer(tmp_path / "tok", documents(200)))],
        "factory returns no module": ["--model", "tests.models.factories:not_a_module"],
    }[case]
    assert_bad_input(p2ptrain("join", *args), *fragments)  # this host (and CI's) reaches no model hub


def test_export_and_generate_refuse_what_is_not_a_checkpoint(tmp_path):
    notes = tmp_path / "notes.pt"
    notes.write_text("not a checkpoint")
    assert_bad_input(p2ptrain("export", str(notes), str(tmp_path / "out")), str(notes))
    assert not (tmp_path / "out").exists()  # nothing half-written
    assert_bad_input(p2ptrain("generate", str(tmp_path)), "neither a checkpoint file nor a folder written by")
