"""`python -m bench.gpu COMMAND`: the GPU micro-benchmarks' entry (see bench/gpu/cli.py)."""
import sys

from bench.gpu.cli import main

sys.exit(main(sys.argv[1:]))
