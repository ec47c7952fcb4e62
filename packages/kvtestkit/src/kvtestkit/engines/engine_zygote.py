"""A warm parent for engine processes: imports torch and vLLM once, then forks one child per engine.

Run by the .venv-vllm interpreter (see `vllm_harness.EngineZygote`):

    python engine_zygote.py SOCKET_PATH

Why: every engine of the suite used to be a fresh interpreter that imported torch, transformers and
vLLM again, about 10 s of a 2-core machine each time, for some 80 engines. A child forked from here
starts with those modules loaded and is still a process of its own: vLLM's process-global state
(the connector agent, the distributed groups, the engine itself) is built in the child and dies with
it, exactly as it did in a fresh interpreter. This process never builds an engine, runs a torch op
or starts a thread, so nothing it holds (an OpenMP pool, a lock taken by another thread) can be
inherited half-made by a child.

Protocol: one connection per engine, one JSON line each way:
  -> {"spec": path, "result": path, "log": path, "cwd": dir, "env": {...}}
  <- {"pid": N}                           once the child is forked
  <- {"rc": N}                            when it has ended (a signal: -N)
A client that closes its connection early (its timeout) gets its child killed, process group and all.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import socket
import sys
import traceback
from typing import Any

# What every engine imports; importing it here is the whole point of this process.
_WARM_MODULES = (
    "torch",
    "transformers",
    "vllm",
    "vllm.v1.engine.llm_engine",
    "vllm.v1.engine.core",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.worker.cpu_model_runner",
    "vllm.v1.attention.backends.cpu_attn",
    "vllm.model_executor.models.llama",
    "vllm.distributed.kv_transfer.kv_connector.v1.base",
)


def _warm() -> None:
    import importlib

    for name in _WARM_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # a module another vLLM version moved: the child imports what it needs
            pass
    import vllm  # noqa: F401  # at least this must be there

    from vllm import LLM, SamplingParams  # noqa: F401


def _child(request: dict[str, Any], listener: socket.socket, conns: list[socket.socket]) -> None:
    """The forked engine process: a fresh session, the run's environment, its log, then the runner."""
    rc = 1
    try:
        listener.close()
        for c in conns:
            c.close()
        os.setsid()  # its own process group: a timeout kills the engine and any worker it started
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        log_fd = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        null_fd = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null_fd, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        os.close(null_fd)
        import random

        random.seed()  # a fresh interpreter seeds from the OS; a fork would share the parent's state
        sys.argv = ["engine_runner.py", request["spec"], request["result"]]
        import kvtestkit.engines.engine_runner as engine_runner

        rc = engine_runner.main(sys.argv)
    except BaseException:  # noqa: BLE001 - the child must never return into the parent's loop
        traceback.print_exc()
        rc = 1
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(rc)


def _serve(path: str) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o600)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    pending: dict[socket.socket, bytes] = {}  # connections whose request line is still arriving
    running: dict[int, socket.socket] = {}  # child pid -> its client's connection
    by_conn: dict[socket.socket, int] = {}
    print("ready", flush=True)
    while True:
        for key, _ in sel.select(timeout=0.05):
            sock = key.fileobj
            assert isinstance(sock, socket.socket)
            if sock is listener:
                conn, _ = listener.accept()
                pending[conn] = b""
                sel.register(conn, selectors.EVENT_READ)
                continue
            data = sock.recv(1 << 16)
            if sock in by_conn:  # a running engine's client said something or went away
                if not data:
                    pid = by_conn.pop(sock)
                    running.pop(pid, None)
                    sel.unregister(sock)
                    sock.close()
                    for kill in (os.killpg, os.kill):  # its group; itself, should it not have run setsid yet
                        try:
                            kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
                    try:
                        os.waitpid(pid, 0)
                    except ChildProcessError:
                        pass
                continue
            if not data:
                pending.pop(sock, None)
                sel.unregister(sock)
                sock.close()
                continue
            pending[sock] += data
            if b"\n" not in pending[sock]:
                continue
            line = pending.pop(sock).split(b"\n", 1)[0]
            request = json.loads(line)
            if request.get("op") == "stop":
                return
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(request, listener, [*pending, *by_conn, sock])
            running[pid] = sock
            by_conn[sock] = pid
            sock.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        while running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if pid not in running:
                continue
            conn = running.pop(pid)
            by_conn.pop(conn, None)
            rc = os.waitstatus_to_exitcode(status)
            try:
                conn.sendall(json.dumps({"rc": rc}).encode() + b"\n")
            except OSError:
                pass
            sel.unregister(conn)
            conn.close()


def main(argv: list[str]) -> int:
    _warm()
    _serve(argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
