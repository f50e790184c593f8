"""A local stand-in for AllenNLP's model storage, for tests of ``elmo_jax.pretrained``.

    with serve_fixture(tmp_path, "original") as server:          # the bundled tiny biLM
        monkeypatch.setenv("ELMO_JAX_MIRROR", server.url)          # under original's released names
        monkeypatch.setitem(pretrained.MODELS, "original", fixture_model("original"))
        config, params = pretrained.load_pretrained("original", cache_dir=tmp_path / "cache")

``ModelServer`` serves a directory laid out with the released relative paths on a free port of
127.0.0.1, from a thread. Unlike ``http.server`` it answers Range requests (206), and it can
misbehave on purpose: cut a transfer after some bytes, ignore Range (200), answer every request
with an HTML page, or pause mid-body. It records every request (method, path, Range header).
"""

from __future__ import annotations

import dataclasses
import http.server
import os
import pathlib
import shutil
import socket
import threading
import time
import urllib.parse

from elmo_jax import pretrained
from elmo_jax.pretrained import MODELS, PretrainedModel


def fixture_files() -> dict[str, pathlib.Path]:
    """The bundled test biLM: role -> file (options, weights)."""
    data = (
        pathlib.Path(pretrained.__file__).parents[1] / "data"
    )  # (no importlib.resources: see test_pretrained's CHILD)
    return {"options": data / "fixture_options.json", "weights": data / "fixture_weights.hdf5"}


def fixture_model(name: str = "original") -> PretrainedModel:
    """Registry entry ``name`` with only options + weights, sized as the bundled fixture files.

    Released files have their own sizes, which the fixture cannot match; tests put this entry in
    the registry (``monkeypatch.setitem(pretrained.MODELS, name, ...)``) or pass it to ``fetch``.
    """
    model = MODELS[name]
    files = {
        role: (dataclasses.replace(model.files[role][0], size=path.stat().st_size),)
        for role, path in fixture_files().items()
    }
    return dataclasses.replace(model, files=files)


def fixture_tree(root: str | os.PathLike, name: str = "original") -> pathlib.Path:
    """Copies the fixture files into ``root`` under model ``name``'s released relative paths."""
    root = pathlib.Path(root)
    for role, src in fixture_files().items():
        dst = root / MODELS[name].files[role][0].path
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst)
    return root


HTML_PAGE = b"<!DOCTYPE html>\n<html><body><h1>Sign in</h1></body></html>\n"


class ModelServer:
    """Serves ``root`` over HTTP on 127.0.0.1 while the ``with`` block runs.

    cut_after, cut_path, cut_times: for the first ``cut_times`` GETs whose path contains
        ``cut_path`` (any path if None), send the full headers but only ``cut_after`` bytes of
        the body, then close the connection.
    ignore_range: answer 200 with the whole file even to a Range request.
    page, page_type: answer every GET with ``page`` (200, Content-Type ``page_type``).
    pause_s, pause_path: sleep this long halfway through the body of paths containing ``pause_path``.
    error, error_times: answer the first ``error_times`` GETs with HTTP status ``error`` (a 503).
    """

    def __init__(
        self,
        root: str | os.PathLike,
        *,
        cut_after: int | None = None,
        cut_path: str | None = None,
        cut_times: int = 1,
        ignore_range: bool = False,
        page: bytes | None = None,
        page_type: str = "text/html",
        pause_s: float = 0.0,
        pause_path: str | None = None,
        error: int | None = None,
        error_times: int = 1,
    ):
        self.root = pathlib.Path(root)
        self.cut_after, self.cut_path, self.cuts_left = cut_after, cut_path, cut_times
        self.ignore_range, self.page, self.page_type = ignore_range, page, page_type
        self.pause_s, self.pause_path = pause_s, pause_path
        self.error, self.errors_left = error, error_times
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        self._httpd = None

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}/"

    def gets(self, substring: str = "") -> list[dict]:
        """The GET requests whose path contains ``substring``, in order."""
        return [r for r in self.requests if r["method"] == "GET" and substring in r["path"]]

    def __enter__(self) -> ModelServer:
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet test output
                pass

            def do_HEAD(self):
                self._serve(body=False)

            def do_GET(self):
                self._serve(body=True)

            def _serve(self, body: bool):
                path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
                rng = self.headers.get("Range")
                server.requests.append({"method": self.command, "path": path, "range": rng})
                if server.error is not None and self.command == "GET":
                    with server._lock:
                        fail, server.errors_left = server.errors_left > 0, server.errors_left - 1
                    if fail:
                        return self._send(server.error, b"try later\n", {"Content-Type": "text/plain"}, body)
                if server.page is not None:
                    return self._send(200, server.page, {"Content-Type": server.page_type}, body)
                file = (server.root / path.lstrip("/")).resolve()
                if server.root.resolve() not in file.parents or not file.is_file():
                    return self._send(404, b"not found\n", {"Content-Type": "text/plain"}, body)
                data = file.read_bytes()
                ctype = "application/json" if file.suffix == ".json" else "application/octet-stream"
                headers = {"Content-Type": ctype, "Accept-Ranges": "bytes"}
                if rng and not server.ignore_range:
                    start = int(rng.removeprefix("bytes=").split("-")[0])
                    if start >= len(data):
                        return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"}, body)
                    headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                    return self._send(206, data[start:], headers, body, path)
                return self._send(200, data, headers, body, path)

            def _send(self, status, data, headers, body, path=""):
                self.send_response(status)
                for k, v in {**headers, "Content-Length": str(len(data))}.items():
                    self.send_header(k, v)
                self.end_headers()
                if not body:
                    return
                with server._lock:
                    cut = (
                        server.cut_after is not None
                        and server.cuts_left > 0
                        and status in (200, 206)
                        and (server.cut_path is None or server.cut_path in path)
                    )
                    if cut:
                        server.cuts_left -= 1
                if cut:
                    self.wfile.write(data[: server.cut_after])
                    self.wfile.flush()
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if server.pause_s and server.pause_path is not None and server.pause_path in path:
                    half = len(data) // 2
                    self.wfile.write(data[:half])
                    self.wfile.flush()
                    time.sleep(server.pause_s)
                    data = data[half:]
                self.wfile.write(data)

        self._httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def serve_fixture(tmp_path: str | os.PathLike, name: str = "original", **options) -> ModelServer:
    """A ``ModelServer`` of the fixture model laid out under ``name``'s released paths in ``tmp_path/mirror``."""
    return ModelServer(fixture_tree(pathlib.Path(tmp_path) / "mirror", name), **options)
