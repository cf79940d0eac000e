"""Where the runner gets its VM spec, and the one-line errors when it cannot.

Sources, first match wins: ``--spec-file PATH`` / ``NEONVM_SPEC_FILE`` (JSON or YAML,
either the ``spec`` object alone or a whole VirtualMachine), else the environment variable
``NEONVM_VM_SPEC`` (the ``spec`` object as JSON). A runner pod gets the file: the
controller writes the spec into a pod annotation and a downward-API volume projects it to
``/vm/spec/spec.json``, because one environment string is limited to 128 KiB by exec and
the whole pod to what the API server accepts. The variable is a fallback for runs by hand
and for pods made by controllers from before the file. The VM's name and namespace come
from ``NEONVM_VM_NAME`` / ``NEONVM_VM_NAMESPACE``, else from the object's metadata.

Guaranteed: a returned spec decoded with :func:`neonvm.api.schema.decode`, the same codec
the controller uses, so the two read a spec the same way. Not checked here: whether the
spec can be run (bounds, files, tools); that is :mod:`neonvm.runner.qemu`'s job.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from neonvm.api import types
from neonvm.api.schema import DecodeError, decode
from neonvm.api.types import VirtualMachineSpec
from neonvm.runner.errors import SpecError

ENV_SPEC = "NEONVM_VM_SPEC"
ENV_SPEC_FILE = "NEONVM_SPEC_FILE"
"""Read by the command's ``--spec-file`` option (:mod:`neonvm.runner.main`)."""
ENV_NAME = "NEONVM_VM_NAME"
ENV_NAMESPACE = "NEONVM_VM_NAMESPACE"


@dataclass(frozen=True)
class LoadedSpec:
    """A decoded spec and the identity of the VM it belongs to."""

    spec: VirtualMachineSpec
    name: str
    namespace: str
    source: str
    """Where the spec came from (a path or the variable name), for messages."""

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}" if self.namespace else self.name


def load_spec(spec_file: Path | None, env: Mapping[str, str]) -> LoadedSpec:
    """The spec from ``spec_file`` or from ``env``; raises :class:`SpecError`."""
    if spec_file is not None:
        source = str(spec_file)
        try:
            text = spec_file.read_text()
        except OSError as exc:
            raise SpecError(f"cannot read spec file {source}: {exc.strerror or exc}") from None
    elif env.get(ENV_SPEC):
        source = ENV_SPEC
        text = env[ENV_SPEC]
    else:
        raise SpecError(f"no VM spec: pass --spec-file (or set {ENV_SPEC_FILE}), "
                        f"or set {ENV_SPEC}")
    spec, meta = parse_spec_document(text, source)
    name = env.get(ENV_NAME) or meta.get("name") or "vm"
    namespace = env.get(ENV_NAMESPACE) or meta.get("namespace") or ""
    return LoadedSpec(spec=spec, name=str(name), namespace=str(namespace), source=source)


def parse_spec_document(text: str, source: str) -> tuple[VirtualMachineSpec, dict[str, Any]]:
    """Decode ``text`` (JSON or YAML; a spec or a whole VirtualMachine) into a spec.

    Returns the spec and the object's metadata (empty for a bare spec).
    """
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError(f"{source}: not JSON or YAML: {problem}") from None
    if not isinstance(doc, dict):
        raise SpecError(f"{source}: expected an object, got {type(doc).__name__}")
    meta: dict[str, Any] = {}
    path = ".spec" if source == ENV_SPEC else ""
    if "kind" in doc or "apiVersion" in doc:
        if doc.get("kind") != types.KIND:
            raise SpecError(f"{source}: kind is {doc.get('kind')!r}, expected {types.KIND}")
        raw_meta = doc.get("metadata")
        meta = raw_meta if isinstance(raw_meta, dict) else {}
        doc = doc.get("spec")
        path = ".spec"
    try:
        spec = decode(VirtualMachineSpec, doc, path)
    except DecodeError as exc:
        raise SpecError(f"invalid VM spec ({source}): {exc}") from None
    return spec, meta
