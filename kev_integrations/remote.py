"""`RemoteEngine`: the part of `Engine` the integrations use, served by a running `kev serve`.

Why a look-alike rather than an OpenAI client: the integrations build engine prompts (chat
messages, tool prompts) and `SamplingParams` (constraints for tools and structured output,
adapters, seeds, cache salts); sending those through Kev's own endpoints keeps every one of
them, and keeps `batch()` = one pack: requests submitted inside `hold()` travel as ONE HTTP
request (one group on the server), as they form one pack locally.

Every request streams server-sent events (one per token, read or not), so once every future of
a request is cancelled the next event closes its connection and the server stops computing it.
Errors come back as the engine's own exception types. With `max_retries`, a request the server
refused for now (429, 503) or never received (a connection error) is sent again after a backoff
(see `retry`); once an answer has started, nothing is retried.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import Any

import httpx

from kev_engine import (
    Completion,
    ConstraintError,
    Delivery,
    EngineClosedError,
    InvalidRequestError,
    KevError,
    Mailbox,
    PassFailedError,
    SamplingParams,
    TextPiece,
    TokenLogprob,
    UnknownAdapterError,
    coerce_sampling,
)

from .retry import RETRY_ERRORS, RETRY_STATUSES, check_max_retries, retry_delay

ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (InvalidRequestError, ConstraintError, UnknownAdapterError, EngineClosedError, PassFailedError)
}
MAX_CONNECTIONS = 32


class RemoteTokenizer:
    """What the integrations read from a tokenizer locally: its chat template (tool support)."""

    def __init__(self, chat_template: str | None) -> None:
        self.chat_template = chat_template


@dataclasses.dataclass
class _Pending:
    prompt: Any
    sampling: SamplingParams
    adapter: str | None
    on_text: Callable[[str], None] | None
    future: Future[Completion]
    mailbox: Mailbox = dataclasses.field(default_factory=Mailbox)  # its text, then its result, in order


def _error(body: dict[str, Any]) -> Exception:
    cls = ERRORS.get(body.get("type", ""), KevError)
    return cls(body.get("message", "the server reported an error"))


def _http_error(response: httpx.Response, retries: int = 0) -> Exception:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:500]
    if response.status_code == 400:
        return InvalidRequestError(message)
    tried = f" (after {retries} retries)" if retries else ""
    return KevError(f"kev serve answered {response.status_code}: {message}{tried}")


class RemoteEngine:
    """Submit, stream and hold against `kev serve` at `base_url` (e.g. ``http://127.0.0.1:8000``).

    `max_retries`: how many times a request is sent again after a connection error, 429 or 503
    (0: never), waiting as the server's Retry-After asks, else with exponential backoff.
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0,
                 max_retries: int = 0) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.max_retries = check_max_retries(max_retries)
        self._closed = threading.Event()  # ends a backoff wait at once
        self._http = httpx.Client(base_url=self.base_url, headers=headers, timeout=timeout,
                                  limits=httpx.Limits(max_connections=MAX_CONNECTIONS))
        info = self._get("/kev/v1/info")
        self.name: str = info["name"]
        self.max_context: int = info["max_context"]
        self.tokenizer = RemoteTokenizer(info["chat_template"])
        self.max_prompts: int = info["max_prompts"]  # a larger held batch travels as several requests
        self._pool = ThreadPoolExecutor(MAX_CONNECTIONS, thread_name_prefix="kev-remote")
        # callbacks run off the threads reading the streams, as in the engine: a slow on_text
        # delays only its own request, never the other prompts of its batch
        self._delivery = Delivery("kev-remote")
        self._lock = threading.Lock()
        self._holds = 0
        self._held: list[_Pending] = []
        self._checked_adapters: set[str] = set()

    # ---- what the integrations call -------------------------------------------------------

    @property
    def adapters(self) -> list[str]:
        return list(self._get("/kev/v1/info")["adapters"])

    def load_adapter(self, name: str, path: str) -> None:
        """Adapters live on the server (`kev serve --adapter`, /admin/adapters): only check the name,
        once per name (integrations ask on every call; one unloaded later fails its requests by name)."""
        if name in self._checked_adapters:
            return
        if name not in self.adapters:
            raise UnknownAdapterError(
                f"adapter {name!r} is not loaded on {self.base_url}; start the server with --adapter "
                f"{name}={path} or load it through /admin/adapters"
            )
        self._checked_adapters.add(name)

    def encode(self, prompt: Any) -> list[int]:
        return list(self._post("/kev/v1/tokenize", {"prompt": prompt})["ids"])

    def text_token_ids(self, text: str) -> list[int]:
        return list(self._post("/kev/v1/tokenize", {"text": text})["ids"])

    def submit(self, prompt: Any, sampling: Any = None, adapter: str | None = None,
               on_text: Callable[[str], None] | None = None, follow_up: bool = False) -> Future[Completion]:
        """As `Engine.submit`; `follow_up` is not sent: the server coalesces what arrives."""
        future: Future[Completion] = Future()
        try:
            pending = _Pending(prompt, coerce_sampling(sampling), adapter, on_text, future)
        except KevError as exc:  # as locally: a bad setting fails its own future
            future.set_exception(exc)
            return future
        with self._lock:
            if self._holds:
                self._held.append(pending)
                return future
        self._pool.submit(self._send, [pending])
        return future

    def expect_follow_up(self, future: Future[Any]) -> _NoExpectation:
        """Nothing to say to a server: it coalesces what arrives within its own window."""
        return _NoExpectation()

    def generate(self, prompts: Sequence[Any], sampling: Any = None, return_exceptions: bool = False,
                 adapters: Any = None) -> list[Any]:
        samplings = sampling if isinstance(sampling, (list, tuple)) else [sampling] * len(prompts)
        names = adapters if isinstance(adapters, (list, tuple)) else [adapters] * len(prompts)
        with self.hold():
            futures = [self.submit(p, s, a) for p, s, a in zip(prompts, samplings, names)]
        results: list[Any] = []
        for future in futures:
            try:
                results.append(future.result())
            except Exception as exc:  # noqa: BLE001 - returned in place, or raised
                if not return_exceptions:
                    raise
                results.append(exc)
        return results

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        """Everything submitted inside travels as one request: one group, one pack on the server."""
        with self._lock:
            self._holds += 1
        try:
            yield
        finally:
            with self._lock:
                self._holds -= 1
                batch, self._held = (self._held, []) if self._holds == 0 else ([], self._held)
            for start in range(0, len(batch), self.max_prompts):
                self._pool.submit(self._send, batch[start : start + self.max_prompts])

    def close(self) -> None:
        self._closed.set()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.close()
        self._delivery.close()

    # ---- HTTP -------------------------------------------------------------------------------

    def _open(self, method: str, path: str, body: Any = None,
              cancelled: Callable[[], bool] = lambda: False) -> httpx.Response:
        """The server's 200 answer, its headers read and its body not yet (close it), after at
        most `max_retries` retries of connection errors, 429 and 503; any other answer raises.
        `cancelled()` true before a retry raises CancelledError: nobody waits for the answer."""
        attempt = 0
        while True:
            response: httpx.Response | None = None
            try:
                response = self._http.send(self._http.build_request(method, path, json=body), stream=True)
            except RETRY_ERRORS as exc:
                if attempt >= self.max_retries:
                    tried = f" (after {attempt} retries)" if attempt else ""
                    raise KevError(f"kev serve at {self.base_url}: {type(exc).__name__}: {exc}{tried}") from exc
            else:
                if response.status_code == 200:
                    return response
                if response.status_code not in RETRY_STATUSES or attempt >= self.max_retries:
                    response.read()
                    response.close()
                    raise _http_error(response, attempt)
                response.close()
            if self._closed.wait(retry_delay(attempt, response.headers if response is not None else None)):
                raise EngineClosedError(f"the client of kev serve at {self.base_url} was closed")
            if cancelled():
                raise CancelledError()
            attempt += 1

    def _get(self, path: str) -> Any:
        response = self._open("GET", path)
        try:
            return json.loads(response.read())
        finally:
            response.close()

    def _post(self, path: str, body: Any) -> Any:
        response = self._open("POST", path, body)
        try:
            return json.loads(response.read())
        finally:
            response.close()

    def _send(self, batch: list[_Pending]) -> None:
        """One HTTP request for the batch; events resolve each future. Runs on the pool."""
        # every request streams its text, even when nobody reads it: an event per token is what lets
        # this loop notice a cancelled batch promptly and hang up (closing from another thread can't)
        body = {"requests": [{"prompt": p.prompt, "sampling": _sampling_dict(p.sampling), "adapter": p.adapter,
                              "stream": True} for p in batch]}

        def cancelled() -> bool:
            return all(p.future.cancelled() for p in batch)

        try:
            # retried only until an answer starts: after that, its text may have reached on_text
            with contextlib.closing(self._open("POST", "/kev/v1/generate", body, cancelled)) as response:
                for line in response.iter_lines():
                    if cancelled():
                        return  # leaving closes the connection: the server cancels the work
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    self._event(batch, json.loads(line.removeprefix("data: ")))
        except CancelledError:
            return  # every caller cancelled while it waited to retry
        except Exception as exc:  # noqa: BLE001 - the transport failed: every unanswered future says so
            error = exc if isinstance(exc, KevError) else KevError(f"kev serve at {self.base_url}: {exc}")
            for pending in batch:
                self._resolve(pending, exc=error)
            return
        for pending in batch:  # a stream that ended early must not leave a caller waiting forever
            self._resolve(pending, exc=KevError("kev serve closed the stream before answering"))

    def _event(self, batch: list[_Pending], event: dict[str, Any]) -> None:
        if "index" not in event:  # the whole stream failed (a Ray replica died mid-way): every unanswered one
            error = event.get("error") or {}
            failure = KevError(f"kev serve at {self.base_url}: {error.get('message', event)}")
            for pending in batch:
                self._resolve(pending, exc=failure)
            return
        pending = batch[event["index"]]
        if "text" in event:
            if pending.on_text is not None:  # as locally: what the callback raises fails its request alone
                logprobs = event.get("logprobs")
                piece = TextPiece(event["text"], event.get("sample", 0),
                                  None if logprobs is None else [TokenLogprob.from_dict(e) for e in logprobs])
                self._delivery.post_text(pending.mailbox, pending.future, pending.on_text, piece)
        elif "completion" in event:
            self._resolve(pending, Completion.from_dict(event["completion"]))
        else:
            self._resolve(pending, exc=_error(event["error"]))

    def _resolve(self, pending: _Pending, result: Any = None, exc: BaseException | None = None) -> None:
        """Resolve a future after the text already posted for it (on a delivery thread)."""
        self._delivery.post_result(pending.mailbox, pending.future, result, exc)


def _sampling_dict(sampling: SamplingParams) -> dict[str, Any]:
    """The settings as JSON (constraints are already canonical text; defaults are left out)."""
    default = SamplingParams()
    return {f.name: list(v) if isinstance(v, tuple) else v
            for f in dataclasses.fields(SamplingParams)
            if (v := getattr(sampling, f.name)) != getattr(default, f.name)}


class _NoExpectation:
    """`RemoteEngine.expect_follow_up`'s handle: there is nothing to end."""

    def end(self) -> None:
        pass
