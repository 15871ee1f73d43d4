"""The lab's commands and their helpers: the router judged on the server family, fault and stress harnesses,
one-off experiments. Nothing a user runs imports this package (tests/test_bench_layers.py)."""
