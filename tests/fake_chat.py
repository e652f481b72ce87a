"""A local OpenAI-compatible chat endpoint for tests (judges, simulated users): ``ChatEndpoint(reply)`` serves
``POST .../chat/completions`` on a free port, ``reply(body)`` giving the assistant's text, or an int HTTP status to
fail with; ``url`` is the base URL (``.../v1``), ``requests`` the bodies received. A context manager."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable


class ChatEndpoint:
    def __init__(self, reply: Callable[[dict], str | int]):
        requests = self.requests = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                requests.append(body)
                out = reply(body)
                if isinstance(out, int):
                    self.send_response(out)
                    self.end_headers()
                    return
                data = json.dumps({"choices": [{"message": {"role": "assistant", "content": out}}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        # a reply slower than the client's timeout ends in a BrokenPipe, which the request thread would print later
        # into another test's captured stderr
        self.server.handle_error = lambda request, client_address: None
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> ChatEndpoint:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
