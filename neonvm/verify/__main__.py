"""``python -m neonvm.verify [explore|scenarios|breakages|invariants] ...``."""

from neonvm.cli.verify import verify

verify(prog_name="python -m neonvm.verify")
