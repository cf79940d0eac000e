"""Thin helpers over the official ``kubernetes`` client: clients from kubeconfig, apply.

Everything that talks to the API server builds its client here, so timeouts and error
wording are the same across the CLI, the controller and the tests.

Which cluster, as kubectl decides it (:func:`resolve`): ``--kubeconfig`` if given, else
the files of ``$KUBECONFIG`` (a colon-separated list; files that do not exist are
skipped, the first file to set a context or ``current-context`` wins), else
``~/.kube/config`` if it exists, else the pod's service account (in-cluster).
``--context`` picks a context of those files instead of their ``current-context``, and
the default namespace is that context's namespace (``default`` when it names none; in a
pod, the service account's namespace).
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.parse
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import urllib3
import yaml
from kubernetes import client, config
from kubernetes.client import rest
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

FIELD_MANAGER = "neonvm"

IN_CLUSTER_NAMESPACE_FILE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
"""Where a pod's service account namespace is mounted (the in-cluster default namespace)."""

DEFAULT_NAMESPACE = "default"

# Cluster-scoped kinds the project applies, and where they live in the REST API.
_CLUSTER_PATHS = {
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition"):
        "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
    ("rbac.authorization.k8s.io/v1", "ClusterRole"):
        "/apis/rbac.authorization.k8s.io/v1/clusterroles",
    ("rbac.authorization.k8s.io/v1", "ClusterRoleBinding"):
        "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings",
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"):
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies",
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding"):
        "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings",
    ("admissionregistration.k8s.io/v1", "MutatingAdmissionPolicy"):
        "/apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicies",
    ("admissionregistration.k8s.io/v1", "MutatingAdmissionPolicyBinding"):
        "/apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicybindings",
    ("v1", "Namespace"): "/api/v1/namespaces",
    ("v1", "Node"): "/api/v1/nodes",
}


RESEND_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
"""The methods urllib3 may send again after the first attempt reached the server."""


def client_retries() -> urllib3.Retry:
    """What every client here lets urllib3 retry by itself: never a write that may have
    reached the server.

    urllib3's default (``Retry(3)``) re-sends a PUT or DELETE after a read timeout or a
    dropped connection, and any method after an ``SSLError`` (its "other" errors), so a
    write that took effect could be applied twice, long after the caller gave up on it.
    Here a request is retried only when it cannot have been sent (connection errors), or
    when it is a read (``RESEND_SAFE_METHODS``: read errors and a 429/503 with
    Retry-After). Writes are the callers' to retry: the controller re-reads and decides
    again (docs/reconciler.md, "Errors").
    """
    return urllib3.Retry(total=3, connect=3, read=3, other=0,
                         allowed_methods=RESEND_SAFE_METHODS)


class TooDeep(ValueError):
    """An answer nested too deeply to decode (``json.loads`` raised RecursionError): an
    object the API server accepted with thousands of levels in a field that preserves
    unknown fields. Nothing of it is returned; :func:`decode_json` reads what it can."""


class KubeconfigError(ConfigException):  # type: ignore[misc]
    """No usable kubeconfig or context; the message is one line, fit for a user."""


@dataclass(frozen=True)
class KubeSource:
    """Where a client's cluster, credentials and default namespace come from."""

    files: tuple[Path, ...]
    """The kubeconfig files, in precedence order; empty: in-cluster (service account)."""
    context: str | None
    """The context used (None: in-cluster, or files without any context)."""
    namespace: str
    """The default namespace: the context's, else ``default``; in a pod, its own."""

    @property
    def in_cluster(self) -> bool:
        return not self.files

    def describe(self) -> str:
        if self.in_cluster:
            return "in-cluster service account"
        files = os.pathsep.join(str(f) for f in self.files)
        return f"{files} (context {self.context})" if self.context else files


def kubeconfig_files(kubeconfig: Path | str | None = None,
                     environ: Mapping[str, str] | None = None) -> tuple[Path, ...]:
    """The kubeconfig files to use, in precedence order; empty means in-cluster.

    ``kubeconfig`` (the ``--kubeconfig`` flag) must exist. ``$KUBECONFIG`` may list several
    files separated by ``:``; missing ones are skipped, but if it names none that exists
    that is an error (as the user plainly meant a file). ``~/.kube/config`` is used only
    when neither is set.
    """
    env = os.environ if environ is None else environ
    if kubeconfig is not None and str(kubeconfig) != "":
        path = Path(kubeconfig).expanduser()
        if not path.is_file():
            raise KubeconfigError(f"kubeconfig {path} does not exist")
        return (path,)
    listed = env.get("KUBECONFIG", "")
    if listed:
        paths = [Path(p).expanduser() for p in listed.split(os.pathsep) if p]
        existing = tuple(dict.fromkeys(p for p in paths if p.is_file()))
        if not existing:
            raise KubeconfigError(f"$KUBECONFIG names no existing file: {listed}")
        return existing
    home = env.get("HOME")
    default = (Path(home) if home else Path.home()) / ".kube" / "config"
    return (default,) if default.is_file() else ()


def _load_files(files: tuple[Path, ...]) -> tuple[str | None, dict[str, dict[str, Any]]]:
    """kubectl's merge of ``files``: the first ``current-context`` and the first
    definition of each context name win."""
    current: str | None = None
    contexts: dict[str, dict[str, Any]] = {}
    for path in files:
        try:
            doc = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise KubeconfigError(f"cannot read kubeconfig {path}: {first}") from exc
        if not isinstance(doc, dict):
            raise KubeconfigError(f"kubeconfig {path} is not a kubeconfig (not a mapping)")
        if current is None and doc.get("current-context"):
            current = str(doc["current-context"])
        for entry in doc.get("contexts") or []:
            if isinstance(entry, dict) and entry.get("name") is not None:
                contexts.setdefault(str(entry["name"]), entry.get("context") or {})
    return current, contexts


def resolve(kubeconfig: Path | str | None = None, context: str | None = None,
            environ: Mapping[str, str] | None = None,
            namespace_file: Path = IN_CLUSTER_NAMESPACE_FILE) -> KubeSource:
    """Which files, context and default namespace a client for these flags uses."""
    files = kubeconfig_files(kubeconfig, environ)
    if not files:
        if context:
            raise KubeconfigError(f"--context {context}: no kubeconfig file (none given, "
                                  "$KUBECONFIG unset and no ~/.kube/config)")
        try:
            namespace = namespace_file.read_text().strip() or DEFAULT_NAMESPACE
        except OSError:
            namespace = DEFAULT_NAMESPACE
        return KubeSource((), None, namespace)
    current, contexts = _load_files(files)
    chosen = context or current
    if context and context not in contexts:
        known = ", ".join(sorted(contexts)) or "none"
        raise KubeconfigError(f"context {context!r} not found in "
                              f"{os.pathsep.join(map(str, files))} (contexts: {known})")
    if chosen is None and len(contexts) == 1:
        chosen = next(iter(contexts))
    namespace = str((contexts.get(chosen or "") or {}).get("namespace") or DEFAULT_NAMESPACE)
    return KubeSource(files, chosen, namespace)


def default_namespace(kubeconfig: Path | str | None = None,
                      context: str | None = None) -> str:
    """The namespace kubectl would use without ``-n`` for these flags."""
    return resolve(kubeconfig, context).namespace


def api_client(kubeconfig: Path | str | None = None,
               context: str | None = None, *, pool_size: int | None = None
               ) -> client.ApiClient:
    """An ApiClient for ``kubeconfig`` and ``context``, resolved as :func:`resolve` says.

    ``pool_size``: connections its HTTP pool keeps (default: the client's, 5 per CPU). A
    client used by more threads at once than its pool holds opens a new connection (a
    TLS handshake) for each request beyond it and throws it away after. Its retries are
    :func:`client_retries` (no write is re-sent by urllib3).

    Raises :class:`KubeconfigError` when there is nothing usable (no file, no in-cluster
    service account, an unknown context).
    """
    source = resolve(kubeconfig, context)
    if source.in_cluster:
        if not os.environ.get("KUBERNETES_SERVICE_HOST"):
            raise KubeconfigError("no kubeconfig: pass --kubeconfig, set $KUBECONFIG or "
                                  "create ~/.kube/config (not running in a pod either)")
        cfg = client.Configuration()
        config.load_incluster_config(client_configuration=cfg)
        if pool_size is not None:
            cfg.connection_pool_maxsize = pool_size
        cfg.retries = client_retries()
        return client.ApiClient(cfg)
    try:
        api = config.new_client_from_config(
            config_file=os.pathsep.join(str(f) for f in source.files),
            context=source.context, persist_config=False)
    except ConfigException as exc:
        if isinstance(exc, KubeconfigError):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else "invalid"
        raise KubeconfigError(f"cannot load kubeconfig {source.describe()}: {first}"
                              ) from exc
    if pool_size is not None:
        api.configuration.connection_pool_maxsize = pool_size
    api.configuration.retries = client_retries()
    api.rest_client.close()  # rebuilt: the pool takes its size and retries when made
    api.rest_client = rest.RESTClientObject(api.configuration)
    return api


def path_segment(name: str) -> str:
    """``name`` as one segment of a REST path: percent-quoted (``/`` too), and never
    ``""``, ``.`` or ``..``, which the URL would resolve to another object (a name read
    from a VM's status must not lead the controller into another namespace;
    docs/security.md, "Tenants")."""
    if name in ("", ".", ".."):
        raise ValueError(f"{name!r} is not an object name")
    return urllib.parse.quote(name, safe="")


RequestObserver = Callable[[str, str, str, float], None]
"""Told of each request sent: (method, host, status code or ``<error>`` when no answer
came, seconds until the answer's head)."""
_OBSERVER = "_neonvm_request_observer"


def observe_requests(api: client.ApiClient, observer: RequestObserver | None) -> None:
    """Tell ``observer`` of every request :func:`_send` sends through ``api`` (the
    controller's ``rest_client_*`` metrics); None stops it."""
    setattr(api, _OBSERVER, observer)


def _send(api: client.ApiClient, method: str, path: str, *, body: Any = None,
          query: list[tuple[str, Any]] | None = None, headers: Mapping[str, str] | None = None,
          timeout: Any = 30.0) -> rest.RESTResponse:
    """One request, its body unread; a non-2xx answer raises ApiException, as the
    generated API classes do (read first, ``ApiException.from_response``). A path with a
    ``.`` or ``..`` segment is refused (ValueError): the client would resolve it to
    another object's path; names go in through :func:`path_segment`."""
    if any(part in (".", "..") for part in path.split("/")):
        raise ValueError(f"refusing a REST path with a dot segment: {path!r}")
    method, url, header_params, payload, _ = api.param_serialize(
        method, path, query_params=query or [], header_params=dict(headers or {}),
        body=body, auth_settings=["BearerToken"])
    observer: RequestObserver | None = getattr(api, _OBSERVER, None)
    started = time.monotonic()
    try:
        resp = api.call_api(method, url, header_params=header_params, body=payload,
                            _request_timeout=timeout)
    except Exception:
        if observer is not None:
            observer(method, _host(api), "<error>", time.monotonic() - started)
        raise
    if observer is not None:
        observer(method, _host(api), str(resp.status), time.monotonic() - started)
    if not 200 <= resp.status <= 299:
        resp.read()
        ApiException.from_response(http_resp=resp, body=None, data=None)  # raises
    return resp


def _host(api: client.ApiClient) -> str:
    """The server's ``host:port``, client-go's ``host`` label."""
    return urllib.parse.urlsplit(str(api.configuration.host)).netloc


def request(
    api: client.ApiClient,
    method: str,
    path: str,
    body: Any = None,
    query: list[tuple[str, str]] | None = None,
    content_type: str = "application/json",
    timeout: float = 30.0,
    accept: str = "application/json",
) -> dict[str, Any]:
    """A raw REST call, the answer as decoded JSON; raises ApiException on non-2xx.

    Used instead of the generated API classes (``CoreV1Api`` and the like): importing
    one loads its module and its pydantic models, about 20 MiB per process, and their
    typed results cost CPU to build only to be turned back into dicts.
    """
    # accept: a metadata-only answer (PartialObjectMetadata) is asked for by its type.
    resp = _send(api, method, path, body=body, query=query, timeout=timeout,
                 headers={"Content-Type": content_type, "Accept": accept})
    resp.read()
    try:
        result: dict[str, Any] = json.loads(resp.data or b"{}")
    except RecursionError:
        raise TooDeep(f"{method} {path}: the answer is nested more deeply than Python's "
                      "JSON decoder goes") from None
    return result


def get_or_none(api: client.ApiClient, path: str, *, accept: str = "application/json",
                timeout: float = 30.0) -> dict[str, Any] | None:
    """A GET, or None when the object does not exist (404; other errors raise)."""
    # Why: "read unless gone" is how every direct read of the controller goes.
    try:
        return request(api, "GET", path, accept=accept, timeout=timeout)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


class Lister:
    """A list (or watch) of one collection, called like a generated list function.

    ``Lister(api, "/api/v1/pods", label_selector="x")(watch=True, resource_version=rv,
    _preload_content=False, ...)`` sends what ``CoreV1Api.list_pod_for_all_namespaces``
    would, and returns what it returns with ``_preload_content=False``: the urllib3
    response, its body unread (a watch streams it; ``iter_resp_lines`` reads it), or
    raises ApiException on a non-2xx answer. The informers, the resync and the sweeps
    take such a callable; this one does not load the generated API classes.
    """

    def __init__(self, api: client.ApiClient, path: str, *, label_selector: str | None = None,
                 field_selector: str | None = None) -> None:
        self.api = api
        self.path = path
        self.label_selector = label_selector
        self.field_selector = field_selector

    def __call__(self, *, watch: bool | None = None, resource_version: str | None = None,
                 allow_watch_bookmarks: bool | None = None, timeout_seconds: int | None = None,
                 limit: int | None = None, _continue: str | None = None,
                 _headers: Mapping[str, str] | None = None, _preload_content: bool = False,
                 _request_timeout: Any = None) -> Any:
        # Why only unpreloaded: every caller decodes the JSON itself (no typed models).
        if _preload_content:
            raise ValueError("Lister answers only unpreloaded responses "
                             "(pass _preload_content=False)")
        query: list[tuple[str, Any]] = [
            (key, value) for key, value in (
                ("allowWatchBookmarks", allow_watch_bookmarks), ("continue", _continue),
                ("fieldSelector", self.field_selector),
                ("labelSelector", self.label_selector), ("limit", limit),
                ("resourceVersion", resource_version), ("timeoutSeconds", timeout_seconds),
                ("watch", watch))
            if value is not None]
        headers = {"Accept": "application/json", **(_headers or {})}
        return _send(self.api, "GET", self.path, query=query, headers=headers,
                     timeout=_request_timeout).response


def release_stream(resp: Any) -> None:
    """Done with a streamed (unpreloaded) response: its connection goes back to the pool
    only if its body was read to the end; otherwise the connection is closed first.

    A watch left early (an error, an ERROR event, a stop) still has a server writing on
    its connection. urllib3's ``release_conn`` alone would pool it as it is, and the next
    request of any thread could be sent on it: written behind the unfinished stream, the
    server reads it only when the stream ends, and the client fails it at once
    (``ResponseNotReady``), so a write can take effect late, or twice if retried.
    (A response without ``closed``, a test's stand-in, counts as read to the end.)
    """
    if not getattr(resp, "closed", True):
        resp.close()
    resp.release_conn()


PRUNE_DEPTH = 512
"""How deep the fallback decoder keeps a document's structure; deeper parts become
:data:`TOO_DEEP`. Far below the ~1,000 levels Python's decoder stops at, far above any
real VM (its deepest free-form field, an affinity, nests about ten levels; its
``managedFields`` mirror that)."""
TOO_DEEP = "\x00neonvm:nested-too-deep"
"""What the fallback decoder puts where it dropped a part nested deeper than
:data:`PRUNE_DEPTH` (a string no API object holds)."""
_TOKENS = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')
"""The JSON tokens that matter for nesting: strings (skipped whole) and brackets."""


def decode_json(text: str | bytes) -> tuple[Any, bool]:
    """``text`` decoded, and whether parts of it were dropped as nested too deep.

    ``json.loads`` recurses once per level and raises ``RecursionError`` at about 1,000
    levels, which the API server accepts in a free-form field. Then the document is
    decoded again with every container deeper than :data:`PRUNE_DEPTH` replaced by
    :data:`TOO_DEEP`, so the rest of it (a list page's other items, an event's metadata)
    can still be read. Only the failing document pays for the second pass. Whoever
    reads an object out of it checks :func:`pruned` before trusting its spec.
    """
    try:
        return json.loads(text), False
    except RecursionError:
        pass
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    return json.loads(_prune(text, PRUNE_DEPTH)), True


def _prune(text: str, depth: int) -> str:
    """``text`` with each container opened deeper than ``depth`` replaced by TOO_DEEP."""
    out: list[str] = []
    level = 0
    copied = 0  # text before this offset is in ``out`` (or dropped)
    marker = json.dumps(TOO_DEEP)
    for token in _TOKENS.finditer(text):
        char = token.group()[0]
        if char == '"':
            continue
        if char in "[{":
            level += 1
            if level == depth + 1:
                out.append(text[copied:token.start()])
        else:
            if level == depth + 1:
                out.append(marker)
                copied = token.end()
            level -= 1
    out.append(text[copied:])
    return "".join(out)


def pruned(obj: Any) -> bool:
    """Whether ``obj`` (a part of what :func:`decode_json` answered) lost a part."""
    return json.dumps(TOO_DEEP) in json.dumps(obj)


LIST_PAGE_BYTES = 8 * 1024 * 1024
"""The most raw bytes one list page may carry (:func:`read_page`): a page above it is
dropped unread and asked for again with a smaller ``limit``. Each item is then decoded
on its own (:func:`list_items`), so what a page costs is its raw text plus one decoded
item, whatever the JSON's shape (docs/security.md, "Exhaustion")."""
ITEM_WINDOW = 4096
"""The first slice :func:`list_items` decodes an item from (it grows 4 times a try, up to
the bound): an item is never decoded from more than its bound's worth of text."""
_DECODER = json.JSONDecoder()


def _ws(text: str, pos: int) -> int:
    """``pos`` moved past JSON whitespace (the API server writes none but a last newline)."""
    while pos < len(text) and text[pos] in " \t\n\r":
        pos += 1
    return pos


class PageTooLarge(Exception):
    """A list page of a single object was above :data:`LIST_PAGE_BYTES`."""


def read_page(resp: Any, cap: int) -> bytes | None:
    """The body of an unpreloaded response, or None (its connection closed) once more
    than ``cap`` bytes arrive: the caller asks again with a smaller ``limit``. (A
    response without ``read``, a test's stand-in, answers its ``data``.)"""
    read = getattr(resp, "read", None)
    if read is None:
        data: bytes = resp.data
        return data if len(data) <= cap else None
    chunks: list[bytes] = []
    total = 0
    while chunk := read(1024 * 1024):
        total += len(chunk)
        if total > cap:
            del chunks
            resp.close()
            return None
        chunks.append(chunk)
    return b"".join(chunks)


@dataclass
class ListItem:
    """One item of a list page (:func:`list_items`)."""

    obj: Any
    """The item decoded; for one above the bound only its head: ``{"metadata": {...}}``
    with its name, namespace, uid, resourceVersion, ..., and its status if that is
    small (:func:`object_head`)."""
    size: int
    """Its raw JSON's length."""
    oversized: bool
    lossy: bool
    """Parts nested too deep were dropped (:func:`decode_json`)."""


def list_items(text: str, bound: int | None, list_meta: dict[str, Any]
               ) -> Iterator[ListItem]:
    """The items of a list page's JSON ``text``, decoded one at a time; the page's own
    ``metadata`` (continue, resourceVersion) is put into ``list_meta`` as it is passed.

    The page is walked with the decoder's scanner and :func:`value_end`, never decoded
    whole. An item longer than ``bound`` characters is not decoded: only its head is
    read (:func:`object_head`); with no bound every item is decoded, one at a time.
    """
    pos = _expect(text, 0, "{")
    while True:
        pos = _ws(text, pos)
        if text[pos] == "}":
            return
        key, pos = _DECODER.raw_decode(text, pos)
        pos = _expect(text, pos, ":")
        pos = _ws(text, pos)
        if key == "items" and text[pos] == "[":
            pos = _ws(text, pos + 1)
            hint = ITEM_WINDOW
            while text[pos] != "]":
                item, pos = _item(text, pos, bound, hint)
                hint = max(ITEM_WINDOW, 2 * item.size)
                yield item
                pos = _ws(text, pos)
                if text[pos] == ",":
                    pos = _ws(text, pos + 1)
            pos += 1
        elif key == "metadata":
            value, pos = _DECODER.raw_decode(text, pos)
            list_meta.update(value or {})
        else:
            pos = value_end(text, pos)
        pos = _ws(text, pos)
        if text[pos] == ",":
            pos += 1


def _expect(text: str, pos: int, char: str) -> int:
    pos = _ws(text, pos)
    if text[pos:pos + 1] != char:
        raise ValueError(f"malformed list: {char!r} expected at {pos}")
    return pos + 1


def _item(text: str, pos: int, bound: int | None, hint: int) -> tuple[ListItem, int]:
    if bound is None:
        try:
            obj, end = _DECODER.raw_decode(text, pos)
            return ListItem(obj, end - pos, False, False), end
        except RecursionError:
            end = value_end(text, pos)
            obj, lossy = decode_json(text[pos:end])
            return ListItem(obj, end - pos, False, lossy), end
    window = min(hint, bound + 1)
    while True:
        stop = min(len(text), pos + window)
        try:
            obj, n = _DECODER.raw_decode(text[pos:stop])
            return ListItem(obj, n, False, False), pos + n
        except json.JSONDecodeError:
            if stop == len(text):
                raise
            if window <= bound:
                window = min(4 * window, bound + 1)
                continue
        except RecursionError:
            pass
        end = value_end(text, pos)
        if end - pos > bound:
            return ListItem(object_head(text, pos, bound // 4), end - pos, True,
                            False), end
        obj, lossy = decode_json(text[pos:end])
        return ListItem(obj, end - pos, False, lossy), end


HEAD_FIELDS = ("name", "namespace", "uid", "resourceVersion", "generation",
               "creationTimestamp", "deletionTimestamp", "finalizers")
"""The ``metadata`` fields an object's head keeps (what a cached stub of a VM too large
to cache needs: its identity, version, deletion and finalizers)."""
HEAD_FIELD_BYTES = 4096
"""A head field whose JSON is longer than this is left out of the head."""


def object_head(text: str, pos: int, status_bytes: int = 0) -> dict[str, Any]:
    """``{"metadata": {...}}`` with the :data:`HEAD_FIELDS` of the object whose JSON
    starts at ``pos``, and (``status_bytes`` > 0) its ``status`` when that is at most
    ``status_bytes`` long; nothing else is decoded (spec, annotations, labels and
    managedFields are skipped by :func:`value_end`)."""
    meta: dict[str, Any] = {}
    head: dict[str, Any] = {"metadata": meta}
    for key, at in _members(text, pos):
        if key == "metadata" and text[at] == "{":
            for field, value_at in _members(text, at):
                if (field in HEAD_FIELDS
                        and value_end(text, value_at) - value_at <= HEAD_FIELD_BYTES):
                    meta[field] = _DECODER.raw_decode(text, value_at)[0]
        elif key == "status" and status_bytes > 0 and text[at] == "{":
            end = value_end(text, at)
            if end - at <= status_bytes:
                status, lossy = decode_json(text[at:end])
                if not lossy:
                    head["status"] = status
    return head


def oversized_event(line: str, bound: int) -> tuple[dict[str, Any], int] | None:
    """For a watch event's JSON ``line`` whose object is longer than ``bound``: the event
    with only the object's head (:func:`object_head`) and the object's length, read
    without decoding the object; None when the object is within the bound (or the line
    is not an event), for the caller to decode it whole. The object's length is measured
    as what follows its start in the line (the API server writes it last)."""
    if len(line) <= bound:
        return None
    event: dict[str, Any] = {}
    size = 0
    for key, at in _members(line, 0):
        if key == "type":
            event["type"] = _DECODER.raw_decode(line, at)[0]
        elif key == "object" and line[at] == "{":
            size = len(line.rstrip()) - at - 1
            if size <= bound:
                return None
            event["object"] = object_head(line, at, bound // 4)
        if len(event) == 2:
            return event, size
    return None


def _members(text: str, pos: int) -> Iterator[tuple[str, int]]:
    """The keys of the JSON object at ``pos``, each with where its value starts; the
    values the caller did not read are skipped (:func:`value_end`)."""
    pos = _expect(text, pos, "{")
    while True:
        pos = _ws(text, pos)
        if text[pos] == "}":
            return
        key, pos = _DECODER.raw_decode(text, pos)
        pos = _ws(text, _expect(text, pos, ":"))
        yield key, pos
        pos = _ws(text, value_end(text, pos))
        if text[pos] == ",":
            pos += 1


def _nested(levels: int) -> str:
    """A pattern of one JSON element holding at most ``levels`` levels of containers: a
    run of scalar characters, a string, or a container of such elements."""
    string = r'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
    element = f'(?:[^\\[\\]{{}}"]++|{string})'
    for _ in range(levels):
        element = f'(?:[^\\[\\]{{}}"]++|{string}|[\\[{{]{element}*+[\\]}}])'
    return element


_SKIP_LEVELS = 12
_CONTAINER = re.compile(f"[\\[{{]{_nested(_SKIP_LEVELS)}*+[\\]}}]")
"""A whole container up to :data:`_SKIP_LEVELS` deep, matched by the regex engine."""
_OPEN_OR_CLOSE = re.compile(f"{_nested(_SKIP_LEVELS)}*+([\\[\\]{{}}])")
"""The next bracket of a deeper container, what the regex engine cannot match whole
skipped (strings, scalars and containers up to :data:`_SKIP_LEVELS` deep)."""


def value_end(text: str, pos: int) -> int:
    """Where the JSON value starting at ``pos`` ends, found without decoding it: a
    container is scanned for its brackets (strings skipped whole, :data:`_TOKENS`), its
    shallower parts by the regex engine (:data:`_CONTAINER`), so a value built of tiny
    JSON objects costs about 30 ms a MiB."""
    pos = _ws(text, pos)
    char = text[pos]
    if char == '"':
        match = _TOKENS.match(text, pos)
        if match is None:
            raise ValueError(f"malformed JSON: unterminated string at {pos}")
        return match.end()
    if char not in "[{":
        return int(_DECODER.raw_decode(text, pos)[1])
    if (whole := _CONTAINER.match(text, pos)) is not None:
        return whole.end()
    level = 0
    for token in _OPEN_OR_CLOSE.finditer(text, pos):
        level += 1 if text[token.start(1)] in "[{" else -1
        if level == 0:
            return token.end()
    raise ValueError(f"malformed JSON: unterminated container at {pos}")


def apply(api: client.ApiClient, obj: dict[str, Any], force: bool = True) -> dict[str, Any]:
    """Server-side apply of a cluster-scoped object (idempotent)."""
    key = (obj["apiVersion"], obj["kind"])
    if key not in _CLUSTER_PATHS:
        raise ValueError(f"apply: unsupported kind {key}")
    return request(
        api,
        "PATCH",
        f"{_CLUSTER_PATHS[key]}/{obj['metadata']['name']}",
        body=obj,
        query=[("fieldManager", FIELD_MANAGER), ("force", "true" if force else "false")],
        content_type="application/apply-patch+yaml",
    )


def api_error_message(err: ApiException) -> str:
    """The API server's own message for a failed call (e.g. a validation error)."""
    try:
        body = json.loads(err.body or "{}")
        return str(body.get("message") or err.reason)
    except (ValueError, TypeError):
        return f"{err.status} {err.reason}"


def short_error(exc: BaseException) -> str:
    """One line for a log or a report: an API error's status and reason, else the type
    and the first line of the message, at most 300 characters."""
    if isinstance(exc, ApiException):
        return f"{exc.status} {exc.reason}"
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:300]
