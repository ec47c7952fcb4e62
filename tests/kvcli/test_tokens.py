"""One token story for kvcli: --token, --token-file, $KVSERVER_API_TOKEN(_FILE), the deprecated
$KVCLI_TOKEN, and a clear refusal naming the flags, against a real server with a configured token."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from kvcli.main import main
from kvcli_testutil import Run, assert_one_line_error

TOKEN = "s3cret-token-for-kvcli"


@pytest.fixture
def guarded(server_factory):
    return server_factory("--l1-size-gb", "0.02", "--api-token", TOKEN, http=True)


def run(tmp_path: Path, *args: str, **env: str) -> Run:
    """kvcli with an empty state directory: the server's own token file is out of reach."""
    clean = {
        "KVSERVER_STATE_DIR": str(tmp_path / "elsewhere"),
        "KVSERVER_API_TOKEN": None,
        "KVSERVER_API_TOKEN_FILE": None,
        "KVCLI_TOKEN": None,
        "KVCLI_COORDINATOR_API_TOKEN": None,
    }
    return Run(CliRunner().invoke(main, list(args), env={**clean, **env}, catch_exceptions=False))


def test_without_a_token_the_refusal_names_the_flags(guarded, tmp_path: Path) -> None:
    refused = run(tmp_path, "describe", "--url", guarded.url)  # (HTTP /v1/status reads are open on loopback)
    assert_one_line_error(refused, "UNAUTHORIZED", "--token")
    as_json = run(tmp_path, "describe", "--url", guarded.url, "--json")
    assert as_json.code == 1 and as_json.json()["ok"] is False and "--token" in as_json.json()["reason"]


def test_token_flag_file_env_and_deprecated_alias(guarded, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    for args, env in (
        (("describe", "--url", guarded.url, "--token", TOKEN), {}),
        (("--token", TOKEN, "describe", "--url", guarded.http_url), {}),
        (("describe", "--url", guarded.url, "--token-file", str(token_file)), {}),
        (("describe", "--url", guarded.url), {"KVSERVER_API_TOKEN": TOKEN}),
        (("describe", "--url", guarded.http_url), {"KVSERVER_API_TOKEN_FILE": str(token_file)}),
    ):
        done = run(tmp_path, *args, "--json", **env)
        assert done.code == 0, (args, done.err)
        assert done.json()["protocol"] == 1
    with pytest.warns(FutureWarning, match="KVCLI_TOKEN is deprecated"):
        legacy = run(tmp_path, "describe", "--url", guarded.url, "--json", KVCLI_TOKEN=TOKEN)
    assert legacy.code == 0, legacy.err
    wrong = run(tmp_path, "describe", "--url", guarded.url, "--token", "not-the-token")
    assert_one_line_error(wrong, "UNAUTHORIZED")
    # a flag given once does not leak into the next invocation in the same process
    assert run(tmp_path, "describe", "--url", guarded.url).code == 1


def test_bad_token_flags_are_usage_errors(tmp_path: Path) -> None:
    missing = run(tmp_path, "describe", "--token-file", str(tmp_path / "absent"))
    assert missing.code == 2 and missing.err.startswith("kvcli: describe:") and "--token-file" in missing.err
    spaced = run(tmp_path, "describe", "--token", "a b")
    assert spaced.code == 2 and "--token" in spaced.err
