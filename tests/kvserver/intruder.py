"""A client process run as another OS user (see test_other_user.py): it tries every op that reads,
writes, pins or clears KV against a real server, and prints what happened to each, as JSON.

Usage: intruder.py ZMQ_URL HTTP_URL ARENA_NAME TOKEN_FILE KEYSPACE_JSON TOKENS_HEX
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import httpx

from kvprotocol import Client, KVProtocolError, ServerError, new_session_id, unpack_tokens


def attempt(fn) -> str:  # type: ignore[no-untyped-def]
    try:
        fn()
        return "OK"
    except ServerError as exc:
        return str(exc.code)
    except KVProtocolError as exc:
        return f"{type(exc).__name__}"
    except OSError as exc:
        return type(exc).__name__


def main() -> None:
    url, http_url, arena, token_file, ks_json, tokens_hex = sys.argv[1:7]
    ks, tokens = json.loads(ks_json), bytes.fromhex(tokens_hex)
    out: dict[str, str] = {}
    out["read_token_file"] = attempt(lambda: Path(token_file).read_text())
    out["open_arena"] = attempt(lambda: Path(f"/dev/shm/{arena}").read_bytes())
    keys = {"keyspace": ks, "tokens": tokens, "salt": "victim"}
    with Client(url, timeout=5) as c:  # finds no token: none in its env, the owner's file is unreadable
        out["ping"] = attempt(lambda: c.call("ping"))
        out["describe"] = attempt(lambda: c.call("describe"))
        steal = new_session_id()
        out["lookup"] = attempt(lambda: c.call("lookup", session=steal, **keys))
        out["retrieve"] = attempt(
            lambda: c.call("retrieve", session=steal, rank=0, start_chunk=0, end_chunk=1, mode="tcp")
        )
        out["query"] = attempt(lambda: c.call("query", **keys))
        out["store"] = attempt(lambda: c.call("store", rank=0, mode="tcp", **keys))
        out["pin"] = attempt(lambda: c.call("pin", **keys))
        out["unpin"] = attempt(lambda: c.call("unpin", **keys))
        out["clear"] = attempt(lambda: c.call("clear"))
    with Client(url, timeout=5, token="guessed-token") as c:
        out["clear_guessed"] = attempt(lambda: c.call("clear"))
    body = {
        "model": ks["model"],
        "world_size": ks["world_size"],
        "groups": ks["groups"],
        "tokens": [int(t) for t in unpack_tokens(tokens)],
        "salt": "victim",
    }
    with httpx.Client(base_url=http_url, timeout=5, trust_env=False) as h:
        for path in ("/v1/query", "/v1/pin", "/v1/unpin", "/v1/clear"):
            out[f"http{path}"] = str(h.post(path, json=body if path != "/v1/clear" else None).status_code)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
