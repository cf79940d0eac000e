"""A failure to inject into the locks' etcd client."""

from __future__ import annotations

import grpc


class _Failure(grpc.RpcError):
    """A gRPC call's failure as the client library raises it (code and details)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details
