"""`python -m bench.quality`: the quality study's command line (cli.py)."""

from bench.quality.cli import main

main()
