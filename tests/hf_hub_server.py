"""A local stand-in for the Hugging Face hub (127.0.0.1, its own thread and event loop), selected
through HF_ENDPOINT: the routes huggingface_hub uses to list a repo and download its files.

    with HubServer() as hub:
        hub.add_repo("org/repo", {"model.gguf": data}); hub.gate("org/private")
        hub.break_after("org/repo", "model.gguf", 1000)   # the connection drops after 1000 bytes
        os.environ["HF_ENDPOINT"] = hub.endpoint; ...; hub.downloads("org/repo", "model.gguf")
"""
from __future__ import annotations

import hashlib

from aiohttp import web

from threaded_server import ThreadedServer

COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


class HubServer(ThreadedServer):
    name = "hf-hub-test-server"

    def __init__(self):
        super().__init__()
        self.repos: dict[str, dict[str, bytes]] = {}
        self.gated: set[str] = set()
        self.gets: list[str] = []         # paths of file bodies served
        self.broken: dict[str, int] = {}  # "repo/name" -> bytes sent before the connection drops

    def add_repo(self, repo: str, files: dict[str, bytes]) -> None:
        self.repos[repo] = dict(files)

    def gate(self, repo: str) -> None:
        self.gated.add(repo)

    def break_after(self, repo: str, name: str, n_bytes: int) -> None:
        """Every download of `name` announces its full length, sends `n_bytes` and drops the connection."""
        self.broken[f"{repo}/{name}"] = n_bytes

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def downloads(self, repo: str, name: str) -> int:
        return self.gets.count(f"{repo}/{name}")

    # ------------------------------------------------------------------ routes
    def _refuse(self, repo: str) -> web.Response | None:
        if repo in self.gated:
            return web.Response(status=401, headers={"X-Error-Code": "GatedRepo",
                                                     "X-Error-Message": f"Access to model {repo} is restricted."})
        if repo not in self.repos:
            return web.Response(status=404, headers={"X-Error-Code": "RepoNotFound",
                                                     "X-Error-Message": "Repository not found"})
        return None

    async def _tree(self, request: web.Request) -> web.Response:
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        refused = self._refuse(repo)
        if refused is not None:
            return refused
        entries, dirs = [], set()
        for name, data in sorted(self.repos[repo].items()):
            parts = name.split("/")
            for i in range(1, len(parts)):
                dirs.add("/".join(parts[:i]))
            entries.append({"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data),
                            "path": name})
        entries += [{"type": "directory", "oid": "0" * 40, "size": 0, "path": d} for d in sorted(dirs)]
        return web.json_response(entries)

    async def _info(self, request: web.Request) -> web.Response:
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        refused = self._refuse(repo)
        if refused is not None:
            return refused
        return web.json_response({"id": repo, "modelId": repo, "sha": COMMIT, "private": False,
                                  "siblings": [{"rfilename": n} for n in sorted(self.repos[repo])]})

    async def _resolve(self, request: web.Request) -> web.Response:
        repo = f"{request.match_info['org']}/{request.match_info['name']}"
        refused = self._refuse(repo)
        if refused is not None:
            return refused
        name = request.match_info["path"]
        data = self.repos[repo].get(name)
        if data is None:
            return web.Response(status=404, headers={"X-Error-Code": "EntryNotFound",
                                                     "X-Error-Message": "Entry not found"})
        headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                   "Content-Length": str(len(data)), "Accept-Ranges": "bytes"}
        if request.method == "HEAD":
            return web.Response(status=200, headers=headers)
        self.gets.append(f"{repo}/{name}")
        cut = self.broken.get(f"{repo}/{name}")
        if cut is None:
            return web.Response(status=200, body=data, headers=headers)
        resp = web.StreamResponse(status=200, headers=headers)
        await resp.prepare(request)
        await resp.write(data[:cut])
        request.transport.close()          # a download that fails midway
        return resp

    def routes(self, app: web.Application) -> None:
        base = "/api/models/{org}/{name}"
        app.router.add_get(base + "/tree/{rev}", self._tree)
        app.router.add_get(base + "/tree/{rev}/{sub:.*}", self._tree)
        app.router.add_get(base + "/revision/{rev}", self._info)
        app.router.add_get(base, self._info)
        app.router.add_route("*", "/{org}/{name}/resolve/{rev}/{path:.*}", self._resolve)
