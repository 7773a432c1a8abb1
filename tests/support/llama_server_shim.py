"""A `llama-server` stand-in for the serving entrypoint tests: the real llama.cpp (llama-cpp-python) behind a
tiny HTTP server with the two endpoints the tests use, taking llama-server's own flags.

This host has llama.cpp's library but not its server binary (llama-cpp-python's server extra is not installed),
so this script is named `llama-server` on the test's PATH. It is the project's own check of the pulled model:
it loads the GGUF the entrypoint pulled, exactly as named by the manifest's serve command, and generates.

    GET  /health      {"status": "ok", "model": <path>, "n_ctx": N, "uid": <uid>, "pid": <pid>}
    POST /completion  {"prompt": str, "n_predict": int} -> {"content": str, "tokens_predicted": int}
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> int:
    ap = argparse.ArgumentParser(prog="llama-server")
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-c", "--ctx-size", type=int, default=4096)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    args = ap.parse_args()
    from llama_cpp import Llama

    llm = Llama(args.model, n_ctx=min(args.ctx_size, 512), n_threads=args.threads, verbose=False)

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, doc: dict) -> None:
            body = json.dumps(doc).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, {"status": "ok", "model": args.model, "n_ctx": args.ctx_size, "uid": os.getuid(),
                                 "pid": os.getpid()})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self):
            if self.path != "/completion":
                self._send(404, {"error": "not found"})
                return
            req = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            out = llm(req.get("prompt", ""), max_tokens=int(req.get("n_predict", 8)), temperature=0.0)
            self._send(200, {"content": out["choices"][0]["text"],
                             "tokens_predicted": out["usage"]["completion_tokens"]})

        def log_message(self, *a):
            pass

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"llama-server (test stand-in) listening on {args.host}:{args.port}", file=sys.stderr, flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
