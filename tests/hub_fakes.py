"""A Hugging Face Hub in a test: its cache laid out on disk, and a small Hub server on 127.0.0.1.

`write_hub_cache` lays a repo out as huggingface_hub's cache does
(models--ORG--NAME/{blobs/<etag>, snapshots/<commit>/<path> -> ../../blobs/<etag>,
refs/<branch or tag>}), so that huggingface_hub itself reads it back. `FakeHub` answers the
few requests `snapshot_download` and `model_info` make (HF_ENDPOINT pointed at it): a model's
info with its commit and files, the recursive tree of a commit, and each file's HEAD and GET
under /resolve/ with the headers huggingface_hub checks (X-Repo-Commit, ETag, Content-Length),
Range requests included; errors carry the Hub's X-Error-Code. It records every request.
`run_cli` runs chatcli in a child process with only the Hub settings given: huggingface_hub
reads HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE, HF_ENDPOINT and HF_TOKEN when it is imported.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

from chatcli.model.checkpoint_paths import EMBEDDED_DIR

ROOT = Path(__file__).resolve().parents[1]
# The embedded model's one checkpoint, whatever step it was saved at.
[EMBEDDED_MODEL] = (EMBEDDED_DIR / "chatsft_checkpoints" / "d6").glob("model_*.pt")
EMBEDDED_STEP = int(EMBEDDED_MODEL.stem.removeprefix("model_"))
EMBEDDED_META = EMBEDDED_MODEL.with_name(f"meta_{EMBEDDED_STEP:06d}.json")
EMBEDDED_TOKENIZER = EMBEDDED_DIR / "tokenizer" / "tokenizer.pkl"


def commit_of(label: str) -> str:
    """A 40-hex commit hash, the same for the same label."""
    return hashlib.sha1(label.encode()).hexdigest()


def flat_files(step: int = EMBEDDED_STEP) -> dict[str, bytes]:
    """The embedded model as a one-checkpoint repo (nanochat's downloads look so), with the
    files a runnable model does not need beside it."""
    return {
        f"model_{step:06d}.pt": EMBEDDED_MODEL.read_bytes(),
        f"meta_{step:06d}.json": EMBEDDED_META.read_bytes(),
        "tokenizer.pkl": EMBEDDED_TOKENIZER.read_bytes(),
        "token_bytes.pt": b"not needed to chat",
        "README.md": b"# A nanochat model\n",
    }


def base_dir_files() -> dict[str, bytes]:
    """The embedded model as a nanochat base dir: tokenizer/ and chatsft_checkpoints/d6/."""
    return {
        "tokenizer/tokenizer.pkl": EMBEDDED_TOKENIZER.read_bytes(),
        f"chatsft_checkpoints/d6/{EMBEDDED_MODEL.name}": EMBEDDED_MODEL.read_bytes(),
        f"chatsft_checkpoints/d6/{EMBEDDED_META.name}": EMBEDDED_META.read_bytes(),
        "README.md": b"# A nanochat base dir\n",
    }


def safetensors_bytes(shapes: dict[str, list[int]]) -> bytes:
    """A float32 .safetensors file of zeros with these tensors."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = 4
        for d in shape:
            n *= d
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + bytes(offset)


def _etag(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_hub_cache(
    cache: Path,
    repo_id: str,
    files: dict[str, bytes],
    commit: str,
    refs: tuple[str, ...] = ("main",),
) -> Path:
    """Lay `files` out as huggingface_hub caches commit `commit` of `repo_id`; the snapshot."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for path, data in files.items():
        blob = repo / "blobs" / _etag(data)
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / path
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@dataclass
class FakeRepo:
    commits: dict[str, dict[str, bytes]]  # commit -> its files
    refs: dict[str, str]  # branch or tag -> commit
    token: str | None = None  # gated: its files need `Authorization: Bearer <token>`
    files_down: bool = False  # its files answer 503, as a Hub in trouble does


@dataclass
class FakeHub:
    """with FakeHub({"org/name": FakeRepo(...)}) as hub: HF_ENDPOINT=hub.url."""

    repos: dict[str, FakeRepo]
    cut_short: set[str] = field(default_factory=set)  # files whose first GET stops halfway
    requests: list[tuple[str, str, str | None]] = field(default_factory=list)  # method, path, Range

    def __enter__(self) -> FakeHub:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                hub.answer(self, body=True)

            def do_HEAD(self) -> None:
                hub.answer(self, body=False)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def downloads(self) -> list[str]:
        """The files fetched with GET, in order (repo path after /resolve/<revision>/)."""
        return [
            p.split("/resolve/", 1)[1].split("/", 1)[1]
            for m, p, _ in self.requests
            if m == "GET" and "/resolve/" in p
        ]

    # ---- answering ------------------------------------------------------------------------

    def answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlsplit(h.path).path)
        self.requests.append((h.command, path, h.headers.get("Range")))
        sent = h.headers.get("Authorization")
        if sent and sent not in {f"Bearer {r.token}" for r in self.repos.values() if r.token}:
            # What the Hub answers a token it does not know, whatever was asked.
            message = "Invalid credentials in Authorization header"
            return self._error(h, 401, "Unauthorized", message, body)
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"]:
            return self._api(h, parts[2:], body)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(h, "/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
        return self._send(h, 404, {}, b'{"error": "no such page"}', body)

    def _repo(self, h: BaseHTTPRequestHandler, repo_id: str, revision: str, body: bool):
        repo = self.repos.get(repo_id)
        if repo is None:
            # The Hub answers 401 for a repo it does not show an anonymous caller.
            self._error(h, 401, "RepoNotFound", "Repository not found", body)
            return None
        commit = repo.refs.get(revision, revision if revision in repo.commits else None)
        if commit is None:
            self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {revision}", body)
            return None
        return repo, commit

    def _api(self, h: BaseHTTPRequestHandler, rest: list[str], body: bool) -> None:
        repo_id, rest = "/".join(rest[:2]), rest[2:]
        if not rest:  # model_info of the default branch
            rest = ["revision", "main"]
        # A revision with / in it (refs/pr/1) arrives quoted as one segment, unquoted here.
        if rest[0] == "revision":
            found = self._repo(h, repo_id, "/".join(rest[1:]), body)
            if found is None:
                return
            repo, commit = found
            info = {
                "id": repo_id,
                "modelId": repo_id,
                "sha": commit,
                "private": False,
                "gated": "manual" if repo.token else False,
                "siblings": [{"rfilename": p} for p in sorted(repo.commits[commit])],
            }
            return self._send(h, 200, {}, json.dumps(info).encode(), body)
        if rest[0] == "tree":
            found = self._repo(h, repo_id, rest[1], body)
            if found is None:
                return
            repo, commit = found
            tree = [
                {"type": "file", "oid": hashlib.sha1(d).hexdigest(), "size": len(d), "path": p}
                for p, d in sorted(repo.commits[commit].items())
            ]
            return self._send(h, 200, {}, json.dumps(tree).encode(), body)
        self._send(h, 404, {}, b'{"error": "no such api"}', body)

    def _resolve(
        self, h: BaseHTTPRequestHandler, repo_id: str, revision: str, name: str, body: bool
    ) -> None:
        found = self._repo(h, repo_id, revision, body)
        if found is None:
            return
        repo, commit = found
        if repo.token and h.headers.get("Authorization") != f"Bearer {repo.token}":
            message = f"Access to model {repo_id} is restricted. You must be authenticated."
            return self._error(h, 401, "GatedRepo", message, body)
        if repo.files_down:
            return self._error(h, 503, "ServiceUnavailable", "Service Unavailable", body)
        data = repo.commits[commit].get(name)
        if data is None:
            return self._error(h, 404, "EntryNotFound", f"{name} does not exist", body)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{_etag(data)}"', "Accept-Ranges": "bytes"}
        start = 0
        if h.headers.get("Range", "").startswith("bytes="):
            start = int(h.headers["Range"][len("bytes=") :].split("-")[0])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        status = 206 if start else 200
        if body and name in self.cut_short and start == 0:
            # Promise the whole file, send half, hang up: what a dropped connection looks like.
            self.cut_short.discard(name)
            h.send_response(200)
            for k, v in {**headers, "Content-Length": str(len(data))}.items():
                h.send_header(k, v)
            h.end_headers()
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            h.close_connection = True
            return
        self._send(h, status, headers, data[start:], body)

    def _error(self, h: BaseHTTPRequestHandler, status: int, code: str, message: str, body: bool):
        headers = {"X-Error-Code": code, "X-Error-Message": message}
        self._send(h, status, headers, json.dumps({"error": message}).encode(), body)

    @staticmethod
    def _send(
        h: BaseHTTPRequestHandler, status: int, headers: dict[str, str], data: bytes, body: bool
    ) -> None:
        h.send_response(status)
        headers = {"Content-Type": "application/json", **headers, "Content-Length": str(len(data))}
        for k, v in headers.items():
            h.send_header(k, v)
        h.end_headers()
        if body:
            h.wfile.write(data)


# ---- chatcli in a child process ---------------------------------------------------------------


def run_cli(*args: str, home: Path, **env: str) -> subprocess.CompletedProcess:
    """`chatcli ARGS` in a child process (run_python's)."""
    return run_python("-m", "chatcli", *args, home=home, **env)


def run_python(*args: str, home: Path, **env: str) -> subprocess.CompletedProcess:
    """`python ARGS` in a child process with only these Hub settings (HF_HOME under `home`
    unless given: no token or cache of the machine's leaks in)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "CHATCLI_"))}
    clean.pop("TRANSFORMERS_OFFLINE", None)
    clean.update(
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
        CHATCLI_HOME=str(home / "chatcli"),
        HF_HOME=str(home / "hf"),
        HF_HUB_DISABLE_TELEMETRY="1",
        **env,
    )
    return subprocess.run(
        [sys.executable, *args], env=clean, capture_output=True, text=True, timeout=180, cwd=ROOT
    )


def one_line_error(result: subprocess.CompletedProcess) -> str:
    """The error a failed command printed: exit code 1, one line, no traceback."""
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error: ")]
    assert len(lines) == 1, result.stderr
    return lines[0]
