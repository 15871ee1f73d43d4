"""Factory fixtures that start simulated SGLang servers on 127.0.0.1, port 0 (owned by the simulator work)."""
