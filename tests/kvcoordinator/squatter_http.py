"""An HTTP listener run as another OS user (test_coordinator_credentials.py): it binds HOST:PORT,
prints "ready", then one JSON line per request with the Authorization header it was sent."""

from __future__ import annotations

import json
import socket
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer


class V6Server(HTTPServer):
    address_family = socket.AF_INET6


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        print(json.dumps({"path": self.path, "authorization": self.headers.get("Authorization")}), flush=True)
        body = b'{"error": "squatter"}'
        self.send_response(401)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    host, port = sys.argv[1], int(sys.argv[2])
    server = (V6Server if ":" in host else HTTPServer)((host, port), Handler)
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
