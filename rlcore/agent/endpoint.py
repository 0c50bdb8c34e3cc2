"""The rank's HTTP endpoint for its agents: ``/v1/chat/completions``, ``/v1/completions`` and
``/v1/models`` (and, with rollout.agent.sandbox, a SandboxFusion-style ``/run_code``), on loopback
only, open for the generate phase only, answering only the keys of the episodes in flight.

One thread per connection (ThreadingHTTPServer's, reused across connections and calls): a thread
parses and renders its request (rlcore.agent.openai_api), hands the Job to the serving loop on the
rank's main thread (the only thread that may drive the engine: rlcore.agent.serve), waits for it,
records the completion in its episode and answers. Responses go out in one write with TCP_NODELAY (a
header and a body in two writes meet Nagle's algorithm and the peer's delayed ACK: 40 ms per
request).

An error is an OpenAI-style ``{"error": {...}}`` with a 4xx status the OpenAI SDK does not retry
(it retries 408, 409, 429 and 5xx): 401 for a key that is not an episode's in flight, 400 for a
request the endpoint cannot serve (the episode fails: rlcore.agent.openai_api.ApiError), 410 for
an episode already over.
"""

from __future__ import annotations

import ipaddress
import json
import queue
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from rlcore.agent.openai_api import ApiError, stream_chunks

MAX_BODY = 64 << 20  # bytes of one request body
_MAX_LINE, _MAX_HEADERS = 65536, 100  # http.client's limits on a request head


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return False


class _Threads:
    """Daemon threads that serve connections, kept for the next one: every episode connects anew each
    call (the endpoint's port is the call's), and a thread started per connection, as ThreadingHTTPServer
    does, cost 0.1-0.2 ms of this process's CPU. One set per process, growing to the most connections
    open at once (each thread blocks on its connection until the client or Endpoint.close ends it)."""

    def __init__(self):
        self.idle: queue.SimpleQueue = queue.SimpleQueue()  # the inboxes of threads waiting for work

    def run(self, fn, *args) -> None:
        try:
            inbox = self.idle.get_nowait()
        except queue.Empty:
            inbox = queue.SimpleQueue()
            threading.Thread(target=self._serve, args=(inbox,), name="rl-agent-connection", daemon=True).start()
        inbox.put((fn, args))

    def _serve(self, inbox: queue.SimpleQueue) -> None:
        while True:
            fn, args = inbox.get()
            try:
                fn(*args)  # ThreadingMixIn.process_request_thread: its errors go to handle_error
            finally:
                self.idle.put(inbox)


_THREADS = _Threads()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True
    request_queue_size = 1024  # every episode of the call may connect at once (the default backlog is 5)

    def __init__(self, *args):
        super().__init__(*args)
        self.open: set[socket.socket] = set()  # connections, kept alive by their clients' pools
        self.open_lock = threading.Lock()

    def process_request(self, request, client_address):
        with self.open_lock:
            self.open.add(request)
        _THREADS.run(self.process_request_thread, request, client_address)

    def shutdown_request(self, request):
        with self.open_lock:
            self.open.discard(request)
        super().shutdown_request(request)

    def close_connections(self) -> None:
        """End every open connection: its thread, blocked reading the client's next request, returns
        (a client's pool would otherwise keep one thread per episode alive after the call)."""
        with self.open_lock:
            for conn in list(self.open):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def handle_error(self, request, client_address):
        """A client gone mid-connection (its episode ended, its process was killed) is no error here."""
        import sys

        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


class Endpoint:
    """The HTTP side. ``submit(job)`` hands a Job to the serving loop; ``on_fail(episode)`` tells it
    an episode failed here (a malformed request: its worker is stopped)."""

    def __init__(self, service, submit, on_fail, port: int = 0, sandbox=None, max_requests: int | None = None):
        self.service, self.submit, self.on_fail, self.sandbox = service, submit, on_fail, sandbox
        self.max_requests = max_requests  # per episode (rollout.agent.max_requests)
        self.keys: dict[str, object] = {}
        self.server = _Server(("127.0.0.1", port), _handler(self))
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       name="rl-agent-endpoint", daemon=True)
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.keys = {}
        self.server.shutdown()
        self.server.server_close()
        self.server.close_connections()

    # ------------------------------------------------------------------ one request

    def handle(self, path: str, key: str | None, body: bytes) -> tuple[int, dict | list]:
        """(status, JSON body, or a list of stream chunks) for one request."""
        episode = self.keys.get(key or "")
        if episode is None:
            return 401, ApiError(401, "unknown API key: each episode gets its own (the api_key its run() was "
                                 "called with), valid while the episode runs", "invalid_api_key").body()
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": self.service.model_name, "object": "model", "created": 0,
                                                     "owned_by": "rlcore"}]}
        kind = {"/v1/chat/completions": "chat", "/v1/completions": "text", "/run_code": "code"}.get(path)
        if kind is None:
            return 404, ApiError(404, f"no route {path}; the endpoint serves /v1/chat/completions, /v1/completions "
                                 "and /v1/models", "not_found").body()
        if kind == "code":
            return self._run_code(episode, body)
        try:
            job = self._job(episode, kind, body)
            return 200, self._serve(job)
        except ApiError as e:
            return e.status, e.body()

    def _job(self, episode, kind: str, body: bytes):
        with episode.lock:
            if episode.closed:
                raise ApiError(410, "this episode is over (its time limit, a refused request, or its end)",
                               "episode_over")
            try:
                try:
                    data = json.loads(body)
                except ValueError as e:
                    raise ApiError(400, f"the body is not JSON: {e}", ends="malformed") from e
                if not isinstance(data, dict):
                    raise ApiError(400, "the body must be a JSON object", ends="malformed")
                req = self.service.parse(kind, data)
                if self.max_requests is not None and episode.asked >= self.max_requests:
                    raise ApiError(400, f"this episode has made its {self.max_requests} requests "
                                   "(rollout.agent.max_requests): it is scored as it stands", "request_limit",
                                   ends="length")
                episode.asked += 1
                return (self.service.chat_job if kind == "chat" else self.service.text_job)(episode, req)
            except ApiError as e:
                self._ended_by(episode, e)
                raise
            except Exception as e:  # a template or tokenizer failure on what the agent sent
                err = ApiError(400, f"the request could not be rendered: {type(e).__name__}: {e}"[:600],
                               ends="malformed")
                self._ended_by(episode, err)
                raise err from e

    def _ended_by(self, episode, err: ApiError) -> None:
        if err.ends == "malformed":
            if episode.end(False, failure="malformed", error=err.message):
                self.on_fail(episode)
        elif err.ends == "length":
            episode.stop_requests()

    def _serve(self, job) -> dict | list:
        self.submit(job)
        job.event.wait()
        if job.error is not None:
            raise job.error
        ep = job.episode
        with ep.lock:
            if not ep.record(job.prompt_ids, job.delta, job.sample[0], job.sample[1]):
                raise ApiError(410, "this episode ended while its request was served", "episode_over")
            self.service.served(job)
            out = (self.service.chat_response if job.kind == "chat" else self.service.text_response)(job)
            ep.history = job.history
            ep.requests += 1
            ep.prompt_tokens += len(job.prompt_ids)
            ep.cached_tokens += job.sample[3]
            ep.tool_calls += len(out["choices"][0].get("message", {}).get("tool_calls") or [])
            ep.latency_s += time.perf_counter() - job.arrived
        if job.kind == "chat" and job.request.stream:
            chunks = stream_chunks(out)
            if job.request.stream_options and job.request.stream_options.include_usage:
                chunks.append({**{k: out[k] for k in ("id", "created", "model")}, "object": "chat.completion.chunk",
                               "choices": [], "usage": out["usage"]})
            return chunks
        return out

    def _run_code(self, episode, body: bytes) -> tuple[int, dict]:
        """SandboxFusion's ``run_code`` for the agent's own code (rlcore.agent.sandbox, the run's limits)."""
        if self.sandbox is None:
            return 404, ApiError(404, "no sandbox: set rollout.agent.sandbox: true", "not_found").body()
        try:
            code = json.loads(body)["code"]
        except (ValueError, KeyError, TypeError):
            return 400, ApiError(400, "send {\"code\": \"...\", \"language\": \"python\"}").body()
        start = time.perf_counter()
        result = self.sandbox(str(code))
        run = {"status": "TimeLimitExceeded" if result.error == "timeout" else "Finished",
               "return_code": 0 if result.ok else 1, "stdout": result.output if result.ok else "",
               "stderr": "" if result.ok else result.output or result.error, "execution_time": time.perf_counter() - start}
        return 200, {"status": "Success" if result.ok else "Failed", "message": result.error or "",
                     "compile_result": None, "run_result": run}


def _handler(endpoint: Endpoint):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def setup(self):
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def log_message(self, *args):  # no access log on the trainer's console
            pass

        def handle_one_request(self):
            """One request. Its head is read here, not by the standard library's parse_request, which
            parses header lines with the email package: 0.2-0.4 ms for the OpenAI SDK's 17 headers, more
            than the endpoint's own work on a request. The endpoint needs the request line and a few
            headers (Content-Length, the key, Connection, Expect): read as ``name: value`` lines, names
            lower-cased, under the standard library's limits (a line, the header count)."""
            self.close_connection = True
            self.headers = {}
            line = self.rfile.readline(_MAX_LINE + 1)
            if not line:
                return
            words = line.decode("iso-8859-1").split()
            if len(line) > _MAX_LINE or len(words) != 3 or words[2] not in ("HTTP/1.0", "HTTP/1.1"):
                return self._reply(400, ApiError(400, "a malformed HTTP/1.x request line").body())
            self.command, self.path, self.request_version = words
            self.headers = headers = _read_head(self.rfile)
            if headers is None:
                return self._reply(431, ApiError(431, f"a header line over {_MAX_LINE} bytes, over "
                                                 f"{_MAX_HEADERS} headers, or one without a colon").body())
            conn = headers.get("connection", "").lower()
            self.close_connection = conn == "close" or (self.request_version == "HTTP/1.0" and conn != "keep-alive")
            if headers.get("expect", "").lower() == "100-continue":
                self.wfile.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            serve = {"GET": self.do_GET, "POST": self.do_POST}.get(self.command)
            if serve is None:
                self.close_connection = True
                return self._reply(405, ApiError(405, f"method {self.command[:20]}: the endpoint takes GET and "
                                                 "POST", "method_not_allowed").body())
            serve()

        def _reply(self, status: int, payload) -> None:
            if isinstance(payload, list):  # a stream: server-sent events, then [DONE]
                data = "".join(f"data: {json.dumps(c)}\n\n" for c in payload) + "data: [DONE]\n\n"
                kind = "text/event-stream"
            else:
                data, kind = json.dumps(payload), "application/json"
            raw = data.encode()
            close = "Connection: close\r\n" if self.close_connection else ""
            head = (f"HTTP/1.1 {status} {self.responses.get(status, ('',))[0]}\r\nContent-Type: {kind}\r\n"
                    f"Content-Length: {len(raw)}\r\n{close}\r\n").encode()
            self.wfile.write(head + raw)
            self.wfile.flush()

        def _key(self) -> str | None:
            auth = self.headers.get("authorization", "")
            return auth[7:].strip() if auth.lower().startswith("bearer ") else self.headers.get("api-key")

        def _route(self, body: bytes) -> None:
            if not is_loopback(self.client_address[0]):  # bound to 127.0.0.1: defence in depth
                self._reply(403, ApiError(403, "loopback only", "forbidden").body())
                return
            path = self.path.split("?", 1)[0].rstrip("/")
            self._reply(*endpoint.handle(path, self._key(), body))

        def do_GET(self):
            self._route(b"")

        def do_POST(self):
            size = self.headers.get("content-length", "0")
            if "transfer-encoding" in self.headers or not size.isdigit() or int(size) > MAX_BODY:
                self.close_connection = True
                self._reply(411 if "transfer-encoding" in self.headers else 413 if size.isdigit() else 400,
                            ApiError(400, f"send the body with a Content-Length of at most {MAX_BODY} bytes "
                                     "(no chunked transfer encoding)").body())
                return
            self._route(self.rfile.read(int(size)))

    return Handler


def _read_head(rfile) -> dict[str, str] | None:
    """The header lines up to the blank one: {lower-cased name: value}, or None past the limits."""
    headers: dict[str, str] = {}
    for _ in range(_MAX_HEADERS + 1):
        line = rfile.readline(_MAX_LINE + 1)
        if line in (b"\r\n", b"\n", b""):
            return headers
        name, colon, value = line.decode("iso-8859-1").partition(":")
        if len(line) > _MAX_LINE or not colon:
            return None
        headers[name.strip().lower()] = value.strip()
    return None
