"""Start-up, configuration sources, clean shutdown and stale shared-memory cleanup."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from kvtestkit.kvhelpers import tiny_layout
from kvtestkit.serverproc import BIN, free_port


def shm(port):
    return Path(f"/dev/shm/kvserver-{port}")


def test_sigterm_and_sigint_leave_the_segment_for_adoption(server_factory):
    for sig in (signal.SIGTERM, signal.SIGINT):
        srv = server_factory("--l1-size-gb", "0.01")
        assert shm(srv.port).exists()
        assert srv.stop(sig, keep_arena=True) == 0
        for left in ("", ".journal", "-ec", "-ec.journal"):  # both segments and their journals
            assert Path(f"{shm(srv.port)}{left}").exists(), left
        assert not Path(f"{shm(srv.port)}.lock").exists()


def test_cold_restart_after_crash_removes_the_stale_segment(server_factory):
    srv = server_factory("--l1-size-gb", "0.01")
    srv.kill()
    assert shm(srv.port).exists()  # a crash leaves it behind ...
    again = server_factory("--l1-size-gb", "0.01", "--cold", port=srv.port)
    assert "removed a stale segment" in again.log() and "a cold start was asked for" in again.log()
    with again.client() as c:
        assert c.call("describe").result["l1"]["objects"] == 0


def test_startup_line_and_config_precedence(server_factory, tmp_path):
    cfg = tmp_path / "kv.toml"
    cfg.write_text('[kvserver]\nchunk-size = 128\neviction_policy = "arc"\nl1-size-gb = 0.02\n')
    srv = server_factory(
        "--config",
        str(cfg),
        "--eviction-policy",
        "s3fifo",
        env={"KVSERVER_LEASE_TTL": "7.5", "KVSERVER_CHUNK_SIZE": "64"},
    )
    line = srv.log().splitlines()[0]
    assert line.startswith("kvserver ") and f"tcp://127.0.0.1:{srv.port}" in line and "0.02 GiB" in line
    with srv.client() as c:
        config = c.call("describe").result["config"]
    assert config["eviction_policy"] == "s3fifo"  # flag beats file
    assert config["chunk_size"] == 64  # env beats file
    assert config["lease_ttl"] == 7.5
    assert config["l1_size_gb"] == 0.02  # file beats default


def test_bad_configuration_is_refused_with_a_message(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("no_such_option = 1\n")
    for args in (["--eviction-policy", "random"], ["--l1-size-gb", "-1"], ["--config", str(bad)]):
        proc = subprocess.run(
            [str(BIN / "kvserver"), "start", "--port", str(free_port()), *args],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert proc.returncode != 0
        assert proc.stderr.strip(), args


def test_module_entry_point_help():
    proc = subprocess.run(
        [sys.executable, "-m", "kvserver", "start", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ},
    )
    assert proc.returncode == 0 and "--eviction-policy" in proc.stdout


def test_engine_registrations_are_logged(server_factory):
    srv = server_factory()
    with srv.client() as c:
        for _ in range(2):  # the same process again: a reconnect keeps its id
            reply = c.call(
                "register_engine",
                model="logged-model",
                world_size=2,
                rank=1,
                host="h1",
                pid=4242,
                groups=[tiny_layout().to_wire()],
            ).result
    first, again = (
        re.search(
            rf"INFO kvserver: engine {reply['engine_id']} registered{w}: model=logged-model "
            r"rank=1/2 host=h1 pid=4242 layouts=[0-9a-f]{16}",
            srv.log(),
        )
        for w in ("", " again")
    )
    assert first and again, srv.log()


def test_config_file_values_must_have_the_fields_type(tmp_path):
    """`port = 5555.5` must not start on 5555, `chunk_size = true` must not mean 1: the key is named."""
    for line, key in (
        ("port = 5555.5", "port"),
        ("chunk_size = true", "chunk_size"),
        ('l1_size_gb = "1"', "l1_size_gb"),
        ("l1_size_gb = nan", "l1_size_gb"),
    ):
        bad = tmp_path / "bad.toml"
        bad.write_text(line + "\n")
        proc = subprocess.run(
            [str(BIN / "kvserver"), "start", "--config", str(bad)], capture_output=True, text=True, timeout=30
        )
        assert proc.returncode != 0 and f"config key {key!r}" in proc.stderr, (line, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_config_file_with_well_typed_values_is_accepted(server_factory, tmp_path):
    good = tmp_path / "good.toml"
    good.write_text('[kvserver]\nl1_size_gb = 0.01\nchunk_size = 128\nl2_admission = "all"\n')
    srv = server_factory("--config", str(good))
    with srv.client() as c:
        assert c.call("describe").result["config"]["chunk_size"] == 128


def test_tenant_quota_must_be_a_finite_size(tmp_path):
    path = tmp_path / "tenants.json"
    for bad in ("nan", "inf", "1e308", "-1"):
        for flag in ("--l1-quota-gb", "--ec-quota-gb"):
            proc = subprocess.run(
                [str(BIN / "kvserver"), "tenant", "add", "alice", "--tenants-file", str(path), flag, bad],
                capture_output=True,
                text=True,
                timeout=30,
            )
            assert proc.returncode == 2 and flag in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
            assert not path.exists()  # nothing written
    ok = subprocess.run(
        [str(BIN / "kvserver"), "tenant", "add", "alice", "--tenants-file", str(path), "--l1-quota-gb", "0.5"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert ok.returncode == 0 and path.exists(), ok.stderr
