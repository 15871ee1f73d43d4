"""Load generation, benchmarks, calibration and the SGLang simulator."""
