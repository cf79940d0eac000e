"""A rights request and its secret, for the rights ledger's tests."""

from __future__ import annotations

from typing import Any

from tests.support.rights import SECRET_UID
from tests.support.rights import secret as token_secret

TOKEN = b"s3cret-token"


POD_UID = "pod-uid-1"


def secret(uid: str = SECRET_UID) -> dict[str, Any]:
    return token_secret(TOKEN, uid)


REQUEST = {"namespace": "ns", "vm": "vm", "podUID": POD_UID}
