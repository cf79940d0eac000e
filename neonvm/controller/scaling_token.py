"""A VM's scaling token, as the controller reads it: from the Secret recorded in the VM's
status, used only if the Secret's uid is the recorded one (a Secret planted under that
name is not used; docs/security.md, "Names stay in their namespace").

One reader for both of its users: live scaling (``RunnerScaling.token`` in
:mod:`neonvm.controller.scaling`, the ``/scale`` bearer) and the rights endpoint
(:class:`neonvm.controller.rights.TokenCache`, the ``/v1/rights`` bearer). Each does its
own GET (their error handling differs); what a read Secret yields is decided here.
"""

from __future__ import annotations

import base64
from typing import Any

from neonvm import kube

TOKEN_KEY = "token"
"""The Secret's data key holding the token (the runner's token file is that key)."""


def secrets_path(namespace: str) -> str:
    return f"/api/v1/namespaces/{kube.path_segment(namespace)}/secrets"


def secret_path(namespace: str, name: str) -> str:
    """A Secret's path; ``name`` (read from a VM's status) percent-quoted
    (docs/security.md, "Names stay in their namespace")."""
    return f"{secrets_path(namespace)}/{kube.path_segment(name)}"


def recorded_token(secret: dict[str, Any] | None, name: str, uid: str) -> bytes | str:
    """The token in ``secret`` (the Secret ``name`` as read; None: not found) if it is the
    recorded one (its uid is ``uid``) and holds a token; otherwise why not, one sentence.

    The token is :data:`TOKEN_KEY` base64-decoded, surrounding whitespace stripped (as the
    runner strips its token file); an empty one is no token, and so is one that is not
    UTF-8 text (the controller writes URL-safe base64 text; other bytes can only be a
    tenant's edit, refused here for both users rather than raising in live scaling:
    docs/security.md, "Names stay in their namespace")."""
    if secret is None:
        return f"Secret {name} not found"
    secret_uid = (secret.get("metadata") or {}).get("uid")
    if secret_uid != uid:
        return (f"Secret {name} is not the one the controller created (uid {secret_uid}, "
                f"recorded {uid}): not used")
    raw = (secret.get("data") or {}).get(TOKEN_KEY)
    try:
        token = base64.b64decode(raw).strip() if raw else b""
    except ValueError:  # binascii.Error: not base64
        return f"Secret {name}: {TOKEN_KEY!r} is not base64"
    if not token:
        return f"Secret {name} has no {TOKEN_KEY!r}"
    try:
        token.decode()
    except UnicodeDecodeError:
        return f"Secret {name}: {TOKEN_KEY!r} is not UTF-8 text: not used"
    return token
