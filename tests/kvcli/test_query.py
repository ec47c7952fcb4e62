"""`kvcli query`: per-chunk presence and the reusable prefix, with keyspaces found from engines."""

from __future__ import annotations

from pathlib import Path

from kvprotocol import Client, chunk_hashes

from kvcli_testutil import CLI, assert_one_line_error
from kvtestkit.kvhelpers import register, store, tiny_layout

TOKENS = list(range(1000, 1000 + 1100))  # 4 full chunks of 256 and a tail


def _seed(server, salt: str = "") -> str:
    layout = tiny_layout()
    with Client(server.url) as c:
        ks, _ = register(c, model="m-q", layouts=[layout])
        store(c, ks, TOKENS[:768], lambda ch, g: bytes(layout.object_bytes), salt=salt)  # chunks 0-2
    return layout.fingerprint


def test_query_by_model_json(cli: CLI, server, tmp_path: Path) -> None:
    fp = _seed(server)
    tokens_file = tmp_path / "tokens.txt"
    tokens_file.write_text("\n".join(map(str, TOKENS)))
    run = cli("query", "--url", server.url, "--model", "m-q", "--tokens-file", str(tokens_file), "--json")
    assert run.code == 0, run.err
    out = run.json()
    assert out["tokens"] == 1100 and len(out["keyspaces"]) == 1
    ks = out["keyspaces"][0]
    assert ks["groups"] == [fp] and ks["world_size"] == 1 and ks["prefix_tokens"] == 768
    assert [c["l1"] for c in ks["chunks"]] == [1, 1, 1, 0]
    assert [c["hash"] for c in ks["chunks"]] == [h.hex() for h in chunk_hashes(TOKENS, 256)]


def test_query_explicit_fingerprint_salt_and_human(cli: CLI, server) -> None:
    fp = _seed(server, salt="tenant-a")
    tokens = ",".join(map(str, TOKENS[:512]))
    plain = cli(
        "query", "--url", server.url, "--model", "m-q", "--tokens", tokens, "--layout-fingerprint", fp, "--json"
    )
    assert plain.code == 0 and plain.json()["keyspaces"][0]["prefix_tokens"] == 0  # salt isolates
    salted = cli("query", "--url", server.url, "--model", "m-q", "--tokens", tokens, "--salt", "tenant-a", "--json")
    assert salted.json()["keyspaces"][0]["prefix_tokens"] == 512
    human = cli("query", "--url", server.url, "--model", "m-q", "--tokens", tokens, "--salt", "tenant-a")
    assert human.code == 0 and "reusable prefix 512 of 512 tokens" in human.out and "yes" in human.out


def test_query_errors(cli: CLI, server, refused_port: int) -> None:
    assert_one_line_error(
        cli("query", "--url", server.url, "--model", "nobody", "--tokens", "1,2"),
        "no engine registered for model 'nobody'",
    )
    assert_one_line_error(
        cli("query", "--url", server.url, "--model", "m", "--tokens", "1", "--layout-fingerprint", "not-hex"),
        "BAD_FIELD",
    )
    assert_one_line_error(
        cli("query", "--url", f"tcp://127.0.0.1:{refused_port}", "--model", "m", "--tokens", "1"), "connection refused"
    )
    bad = cli("query", "--url", server.url, "--model", "m", "--tokens", "1,x")
    assert bad.code == 2 and "cannot parse token ids" in bad.err
    both = cli("query", "--url", server.url, "--model", "m")
    assert both.code == 2 and "exactly one of --tokens and --tokens-file" in both.err
    with Client(server.url) as c:  # and the server is still serving
        assert c.call("ping").result["protocol"] == 1
