"""A real HTTP server on loopback that misbehaves on purpose, for `deploykit bench`'s error handling: it serves
/v1/models, then answers completions in turn with a good stream, a 500, a 429, a stream whose connection is cut
mid-body, and an error event inside the stream; "grouped" streams its tokens two to a chunk and ends with
finish_reason "length", as servers that hold back partial UTF-8 do; "trickle" sends a good stream a few bytes at a
time (lines split across reads); "stall" sends one chunk and then nothing for `delay` seconds. `idle` closes a
kept-alive connection after that many idle seconds; `tls` (cert, key) serves HTTPS. No usage chunk and no
/tokenize: bench must count chunks (or trust "length") and estimate prompt lengths, and say so."""
from __future__ import annotations

import itertools
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

BEHAVIOURS = ("good", "500", "429", "drop", "stream-error")


class Misbehaving:
    def __init__(self, behaviours=BEHAVIOURS, chunks: int = 4, delay: float = 0.0, idle: float | None = None,
                 tls: tuple[str, str] | None = None):
        turn = itertools.cycle(behaviours)
        lock = threading.Lock()
        outer = self
        self.completions = 0  # completion requests answered so far
        self.connections = 0  # connections accepted so far

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = idle  # a kept-alive connection idle this long is closed

            def setup(self) -> None:
                with lock:
                    outer.connections += 1
                super().setup()

            def log_message(self, *args) -> None:
                pass

            def _json(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _chunk(self, text: str) -> None:
                data = text.encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def do_GET(self) -> None:
                if self.path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
                else:
                    self._json(404, {"error": {"message": "not found"}})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/completions":
                    return self._json(404, {"error": {"message": "not found"}})
                with lock:
                    what = next(turn)
                    outer.completions += 1
                if what == "500":
                    return self._json(500, {"error": {"message": "engine exploded", "type": "server_error"}})
                if what == "429":
                    return self._json(429, {"error": {"message": "queue full", "type": "rate_limit"}})
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                if what == "trickle":
                    events = "".join("data: " + json.dumps({"choices": [{"index": 0, "text": f"t{i} "}]}) + "\r\n\r\n"
                                     for i in range(chunks)) + "data: [DONE]\r\n\r\n"
                    for i in range(0, len(events), 5):
                        self._chunk(events[i:i + 5])
                        time.sleep(0.001)
                    self.wfile.write(b"0\r\n\r\n")
                    return
                if what == "stall":
                    self._chunk("data: " + json.dumps({"choices": [{"index": 0, "text": "t0 "}]}) + "\n\n")
                    time.sleep(delay)
                    return
                if what == "grouped":
                    for i in range(0, chunks, 2):
                        last = i + 2 >= chunks
                        self._chunk("data: " + json.dumps({"choices": [{"index": 0, "text": f"t{i} t{i + 1} ",
                                                                        "finish_reason": "length" if last else None}]})
                                    + "\n\n")
                    self._chunk("data: [DONE]\n\n")
                    self.wfile.write(b"0\r\n\r\n")
                    return
                for i in range(chunks):
                    time.sleep(delay)  # the behaviour: a server that streams slowly
                    self._chunk("data: " + json.dumps({"choices": [{"index": 0, "text": f"t{i} "}]}) + "\n\n")
                    if what == "drop" and i == 1:
                        self.connection.shutdown(socket.SHUT_RDWR)  # cut mid-body: no terminating chunk
                        self.close_connection = True
                        return
                    if what == "stream-error" and i == 1:
                        self._chunk("data: " + json.dumps({"error": {"message": "stopped mid-way"}}) + "\n\n")
                        break
                self._chunk("data: [DONE]\n\n")
                self.wfile.write(b"0\r\n\r\n")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        if tls:
            import ssl
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*tls)
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.url = f"http{'s' if tls else ''}://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> Misbehaving:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
