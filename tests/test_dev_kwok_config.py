"""The local cluster's kwok options (``neonvm/dev/kwok/kwok-config.yaml``): a
KwokConfiguration read from a file gets none of kwok's defaults, so every parallelism kwok
starts a controller with must be written out (kwok v0.8.0 exits at start-up with "node
leases parallelism must be greater than 0" otherwise), and pods get more than kwok's
default of 4 stage players (docs/benchmarks.md, "A namespace of 5,000 VMs deleted with the
replicas running")."""

from __future__ import annotations

import pytest
import yaml

from neonvm.dev.nodes import stage_files

pytestmark = pytest.mark.unit

PARALLELISMS = ("podPlayStageParallelism", "nodePlayStageParallelism",
                "nodeLeaseParallelism", "podsOnNodeSyncParallelism")


def test_kwok_is_given_its_options_with_more_pod_stage_players_than_its_default() -> None:
    configs = [doc for path in stage_files() for doc in yaml.safe_load_all(path.read_text())
               if doc and doc.get("kind") == "KwokConfiguration"]
    assert len(configs) == 1, "one KwokConfiguration among kwok's --config files"
    options = configs[0]["options"]
    assert all(int(options[name]) > 0 for name in PARALLELISMS), options
    assert int(options["podPlayStageParallelism"]) > 4
