#!/usr/bin/env bash
# Runs every test. On a fresh machine it first installs the Python peers the
# interop tests talk to (PyTorch, grpcio, safetensors) into a virtualenv
# cached under ~/.cache/tensorwire; when tests/python/requirements.txt changes,
# only what changed is installed into it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

req="tests/python/requirements.txt"
key="$(sha256sum "$req" | cut -c1-16)"
venv="${TENSORWIRE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/tensorwire/venv}"
if [ ! -x "$venv/bin/python" ]; then
  echo "== setting up Python peers in $venv (first run only: a few minutes, ~5 GB)"
  python3 -m venv "$venv"
fi
if [ "$(cat "$venv/.requirements-key" 2>/dev/null)" != "$key" ] ||
   ! "$venv/bin/python" -c "import torch, grpc, grpc_tools, grpc_health, grpc_reflection, safetensors" >/dev/null 2>&1; then
  echo "== installing Python peers from $req into $venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req"
  echo "$key" > "$venv/.requirements-key"
fi
export TENSORWIRE_PYTHON="$venv/bin/python"
export TENSORWIRE_REQUIRE_PYTHON=1

echo "== structure: no import cycle between the files of any crate"
python3 tools/import_cycles.py
python3 tools/import_cycles.py python/src

echo "== Rust tests (workspace; feature fuzzing replays the fuzz corpus)"
if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --features fuzzing --no-fail-fast "$@"
  cargo test --workspace --doc --quiet
  echo "== 500 concurrent clients on each of tcp, tcps, unix, quic, grpc (ignored by default: slow)"
  cargo nextest run --features fuzzing --test concurrency --run-ignored only --no-fail-fast --test-threads 1
  echo "== GPU code (feature cuda): builds everywhere; tests skip with a reason where there is no CUDA"
  cargo nextest run -p tensorwire --features cuda --lib --test gpu --no-fail-fast -E 'test(cuda::) | test(pipeline::) | binary(gpu)'
  cargo build --features cuda --example gpu_bench
else
  cargo test --workspace --features fuzzing "$@"
  cargo test --features fuzzing --test concurrency -- --ignored --test-threads 1
fi

echo "== Python package (python/): clippy, build into $venv, pytest tests/python/"
# python/ is its own workspace (an extension module cannot link the
# workspace's test binaries; see python/README.md): lint it here, and share
# the workspace's target directory so its dependencies build once.
target_dir="$(cargo metadata --format-version 1 --no-deps | "$TENSORWIRE_PYTHON" -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
CARGO_TARGET_DIR="$target_dir" cargo clippy --manifest-path python/Cargo.toml --all-targets --quiet -- -D warnings
cargo build --quiet --bin tensorwire --example client
# Rebuild the package only when a source it is built from changed.
pykey="$(cat Cargo.lock python/Cargo.lock python/Cargo.toml python/pyproject.toml Cargo.toml \
  $(git ls-files -co --exclude-standard python/src python/tensorwire src codecs transports proto 2>/dev/null | grep -v '^src/bin/' | sort) \
  | sha256sum | cut -c1-16)"
if [ "$(cat "$venv/.tensorwire-python-key" 2>/dev/null)" != "$pykey" ] || ! "$TENSORWIRE_PYTHON" -c "import tensorwire" >/dev/null 2>&1; then
  echo "== building the tensorwire Python package (maturin develop)"
  VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" CARGO_TARGET_DIR="$target_dir" \
    "$venv/bin/maturin" develop --quiet -m python/Cargo.toml
  echo "$pykey" > "$venv/.tensorwire-python-key"
fi
rc=0
TENSORWIRE_BIN="$target_dir/debug/tensorwire" "$TENSORWIRE_PYTHON" -m pytest -q tests/python/ || rc=$?
if [ "$rc" -eq 5 ]; then
  # pytest's "no tests collected": the suite vanished, which is a failure here.
  echo "pytest collected no tests in tests/python/" >&2
  exit 1
elif [ "$rc" -ne 0 ]; then
  exit "$rc"
fi
echo "== the Python package and its examples type-check (mypy --strict, with the package's stubs)"
(cd python && "$TENSORWIRE_PYTHON" -m mypy --strict --no-error-summary tensorwire)
"$TENSORWIRE_PYTHON" -m mypy --strict --no-error-summary examples/python/

echo "== UCX (feature ucx): ucx:// over UCX's TCP and shared-memory transports, and its default"
ucx_ready() { pkg-config --exists ucx 2>/dev/null && command -v ucx_perftest >/dev/null 2>&1; }
if ! ucx_ready && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "== installing libucx-dev ucx-utils (first run only)"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libucx-dev ucx-utils >/dev/null
fi
if ucx_ready; then
  # tcp, shared memory, and UCX's default (all: same-host peers then get
  # workers limited to shared memory, see transports/src/ucx/ffi.rs).
  for tls in tcp sm,self all; do
    echo "== UCX_TLS=$tls"
    if cargo nextest --version >/dev/null 2>&1; then
      UCX_TLS=$tls cargo nextest run -p tensorwire --features ucx --no-fail-fast --test ucx --test pipeline -E 'test(/ucx/) | binary(ucx)'
    else
      UCX_TLS=$tls cargo test -p tensorwire --features ucx --test ucx -- --test-threads=1
      UCX_TLS=$tls cargo test -p tensorwire --features ucx --test pipeline -- ucx::
    fi
  done
else
  echo "== skipped: UCX is not installed and cannot be installed here (needs root and apt-get: apt-get install libucx-dev ucx-utils)"
fi
