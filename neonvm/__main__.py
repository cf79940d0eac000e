"""``python -m neonvm`` is the ``neonvm`` command."""

from neonvm.cli import main

main()
