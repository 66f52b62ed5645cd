"""``python -m engine``: the same CLI as the ``engine`` command."""

from engine.cli import main

main()
