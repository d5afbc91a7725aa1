"""The web console: the chat page at `/`, the dashboard at `/dashboard`, files at `/static/`.

Everything is in the package (app/static/: plain HTML, CSS and JS, uPlot vendored as one
file with its license), read once at start: no build step, no node, no CDN, works
offline. Caching: the pages are `no-cache` (revalidated by ETag, so a new version shows at
once) and name their files with a content hash (`/static/chat.js?v=1a2b3c4d`), which may
then be cached for a year; a stale hash still gets the current file, revalidated. The
pages need no key to load; their API calls carry the one the user typed (kept in the
browser's local storage). `server.console = false` serves none of it.
"""

from __future__ import annotations

import hashlib
import mimetypes
import re
from dataclasses import dataclass
from importlib import resources

from quart import Response, request
from quart_trio import QuartTrio

from .errors import APIError

PAGES = {"/": "index.html", "/dashboard": "dashboard.html"}
_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
          ".html": "text/html; charset=utf-8", ".svg": "image/svg+xml", ".txt":
          "text/plain; charset=utf-8"}
# uPlot sets element styles from script, hence 'unsafe-inline' for styles only.
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
        "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'")


@dataclass(frozen=True)
class _File:
    body: bytes
    content_type: str
    etag: str


def load_static() -> dict[str, _File]:
    """Every file under app/static (by its path there): the pages with the shared
    partials (app/static/partials: `<!-- include NAME -->`) in place and hashed file
    links; the partials themselves are not served."""
    root = resources.files("app") / "static"
    raw: dict[str, bytes] = {}

    def walk(node, prefix: str) -> None:
        for child in node.iterdir():
            if child.is_dir():
                walk(child, f"{prefix}{child.name}/")
            else:
                raw[prefix + child.name] = child.read_bytes()

    walk(root, "")
    partials = {name[len("partials/"):-len(".html")]: raw.pop(name).decode()
                for name in [n for n in raw if n.startswith("partials/")]}
    pages = {name: path for path, name in PAGES.items()}
    for name in pages:  # the shared head and header, this page's nav link current
        html = re.sub(r"<!-- include (\w+) -->\n", lambda m: partials[m.group(1)],
                      raw[name].decode())
        link = f'<a href="{pages[name]}">'
        raw[name] = html.replace(link, link[:-1] + ' aria-current="page">', 1).encode()
    digest = {name: hashlib.sha256(body).hexdigest()[:10] for name, body in raw.items()}
    link = re.compile(rb'(["\'])/static/([\w./-]+)\1')

    def hashed(m: re.Match) -> bytes:
        name = m.group(2).decode()
        v = f"?v={digest[name]}".encode() if name in digest else b""
        return m.group(1) + b"/static/" + m.group(2) + v + m.group(1)

    files = {}
    for name, body in raw.items():
        if name.endswith(".html"):
            body = link.sub(hashed, body)
        ext = "." + name.rpartition(".")[2]
        ctype = _TYPES.get(ext) or mimetypes.guess_type(name)[0] or "application/octet-stream"
        files[name] = _File(body, ctype, '"' + hashlib.sha256(body).hexdigest()[:16] + '"')
    return files


def register_console(app: QuartTrio) -> None:
    files = load_static()

    def send(f: _File, cache: str) -> Response:
        headers = {"Cache-Control": cache, "ETag": f.etag, "X-Content-Type-Options": "nosniff"}
        if f.content_type.startswith("text/html"):
            headers["Content-Security-Policy"] = _CSP
            headers["Referrer-Policy"] = "no-referrer"
        if f.etag in request.headers.get("If-None-Match", ""):
            return Response(b"", status=304, headers=headers)
        return Response(f.body, content_type=f.content_type, headers=headers)

    def page(name: str):
        async def handler() -> Response:
            return send(files[name], "no-cache")
        handler.__name__ = f"console_{name.split('.')[0]}"
        return handler

    for path, name in PAGES.items():
        app.add_url_rule(path, view_func=page(name), methods=["GET"])

    @app.get("/static/<path:name>")
    async def static_file(name: str) -> Response:
        f = files.get(name)
        if f is None or name.endswith(".html"):  # a 404 in the API's shape, like any other
            raise APIError(404, f"No such file: /static/{name}", type="not_found_error",
                           code="not_found")
        fresh = request.args.get("v") == f.etag.strip('"')[:10]
        return send(f, "public, max-age=31536000, immutable" if fresh else "no-cache")
