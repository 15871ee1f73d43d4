"""s43: the prompt covariate's early samples on the pure policy: s42's replay (bench/results/ab-s42/covariate-replay.py,
its serving of the llama.cpp pair's 36 measured prompts, tables and seeds) with this build's modes: s41's build
(COVARIATE_SAMPLES out of reach, MAX_EARLY 0), the covariate with samples folded at once and never rebuilt
(MAX_EARLY 0), and this build (the first samples folded unmoved, the models rebuilt from them moved once the
covariate is measured). s42's build, whose first samples waited out of the models, is the third table of
bench/results/ab-s42/covariate-replay.txt (the same seeds and prompts).
Run: .venv/bin/python bench/results/ab-s43/covariate-replay.py > bench/results/ab-s43/covariate-replay.txt"""
import importlib.util

spec = importlib.util.spec_from_file_location("replay_s42", "bench/results/ab-s42/covariate-replay.py")
replay = importlib.util.module_from_spec(spec)
spec.loader.exec_module(replay)
replay.MODES = {"s41 (no covariate)": (10**9, 0), "covariate, samples folded at once": (8, 0),
                "covariate, the models rebuilt once it is measured (this build)": (8, 16)}

if __name__ == "__main__":
    print("the measured requests (engine-scatter.txt, round 0):")
    replay.scatter()
    for slow in (1.0, 1.15, 1.3):
        for mode in replay.MODES:
            replay.table(slow, mode)
    print("every request to one engine, 10 seeds of 80 requests (speculative decode x1.30):")
    for pool in ("speculative", "baseline"):
        for mode in replay.MODES:
            replay.alone(pool, mode)
