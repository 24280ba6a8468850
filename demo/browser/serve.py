"""Static server for the browser demo, on 127.0.0.1 only, logging every request.

Routes: `/` → demo/browser/ (pages, JS, vendor/ with Pyodide and wheels);
`/models/<model id>/<file>` → model_cache/model/<model id>/<file> (the default models, same origin).
Pages and wheels are served with `Cache-Control: no-cache` so a rebuilt wheel is always picked up;
model files are cached by the page itself in the Cache API, which is what a reload must hit.

    python demo/browser/serve.py [--port 8000] [--log requests.log]
"""
from __future__ import annotations

import argparse
import mimetypes
import posixpath
import sys
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
MODELS = ROOT / "model_cache" / "model"

mimetypes.add_type("text/javascript", ".mjs")
mimetypes.add_type("text/javascript", ".js")
mimetypes.add_type("application/wasm", ".wasm")
mimetypes.add_type("text/plain", ".wgsl")
mimetypes.add_type("application/octet-stream", ".gguf")
mimetypes.add_type("application/octet-stream", ".safetensors")
mimetypes.add_type("application/zip", ".whl")


class Handler(SimpleHTTPRequestHandler):
    log_file = None
    log_lock = threading.Lock()
    routes: dict = {"models": MODELS}      # first path part -> folder

    def translate_path(self, path: str) -> str:
        path = posixpath.normpath(unquote(urlsplit(path).path))
        parts = [p for p in path.split("/") if p and p not in (".", "..")]
        if parts and parts[0] in self.routes:
            return str(Path(self.routes[parts[0]]).joinpath(*parts[1:]))
        return str(HERE.joinpath(*parts))

    def end_headers(self) -> None:
        self.send_header("Cache-Control", "no-cache")
        super().end_headers()

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
        line = "%s %s\n" % (self.address_string(), format % args)
        with self.log_lock:
            sys.stdout.write(line)
            sys.stdout.flush()
            if self.log_file:
                with open(self.log_file, "a") as f:
                    f.write(line)


def serve(port: int = 8000, log: str | None = None, routes: dict | None = None) -> ThreadingHTTPServer:
    """`routes`: more {first path part: folder} served (the tests' MLC folders)."""
    Handler.log_file = log
    Handler.routes = {"models": MODELS, **(routes or {})}
    httpd = ThreadingHTTPServer(("127.0.0.1", port), partial(Handler, directory=str(HERE)))
    return httpd


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    ap.add_argument("--log", default=None, help="also append request lines to this file")
    a = ap.parse_args()
    httpd = serve(a.port, a.log)
    print(f"serving the browser demo on http://127.0.0.1:{httpd.server_address[1]}/", flush=True)
    try:
        httpd.serve_forever()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
