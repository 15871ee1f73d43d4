"""GPU micro-benchmarks (issues 32, 33): step cost vs tokens, context and prompt on a real GPU; needs only torch.

Pure modules (shapes, routing, floors, schema) import no torch; kernels, suite and tp do, lazily, from cli.
"""
