#!/usr/bin/env bash
# Creates or reuses the project environment in .venv/ (idempotent).
#
# What it does, in order:
#   1. system packages (OpenMPI, a C++ compiler, iproute2, the Fashion-MNIST data set) via
#      apt-get when missing (needs root);
#   2. .venv with Python 3.11 and the pinned packages of scripts/constraints.txt (and of
#      docs/requirements.txt, the documentation site's);
#   3. Horovod compiled from PyPI's source archive with PyTorch + TensorFlow + Gloo + MPI,
#      the wheel cached in $HOROVOD_DGC_CACHE (default ~/.cache/horovod_dgc) keyed by the
#      Horovod, Python, torch and TensorFlow versions, so later set-ups take seconds.
# HOROVOD_DGC_VENV and HOROVOD_DGC_SYSTEM_PACKAGES override the venv path and the apt list.
# Every failure that a user can fix ends with one sentence saying what is missing.
set -euo pipefail

HOROVOD_VERSION=0.28.1
PYTHON=${PYTHON:-python3.11}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HOROVOD_DGC_VENV:-$ROOT/.venv}
CONSTRAINTS=$ROOT/scripts/constraints.txt
# The documentation site's packages (make docs, and its build in make test), pinned.
DOCS_REQUIREMENTS=$ROOT/docs/requirements.txt
CACHE=${HOROVOD_DGC_CACHE:-$HOME/.cache/horovod_dgc}
STAMP=$VENV/.horovod_dgc-setup
read -r -a SYSTEM_PACKAGES <<<"${HOROVOD_DGC_SYSTEM_PACKAGES:-libopenmpi-dev openmpi-bin g++ iproute2 dataset-fashion-mnist}"

say() { printf 'setup: %s\n' "$*" >&2; }
die() { printf 'setup: ERROR: %s\n' "$*" >&2; exit 1; }

pinned() { sed -n "s/^$1==//p" "$CONSTRAINTS"; }

setup_fingerprint() {
    cat "$CONSTRAINTS" "$DOCS_REQUIREMENTS" "$ROOT/setup.py" "${BASH_SOURCE[0]}" \
        "$ROOT"/horovod_dgc/torch/kernels/*.[ch] \
        | sha256sum | cut -c1-16
}

ensure_system_packages() {
    local missing=()
    for pkg in "${SYSTEM_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    command -v apt-get >/dev/null || die "system packages ${missing[*]} are missing and there is no apt-get to install them; install them by hand."
    [ "$(id -u)" -eq 0 ] || die "system packages ${missing[*]} are missing and installing them needs root: run 'sudo apt-get install ${missing[*]}' and then this command again."
    say "installing system packages: ${missing[*]}"
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"; } \
        >"$CACHE/apt.log" 2>&1 \
        || die "apt-get could not install ${missing[*]} (no network to the Debian registry?); see $CACHE/apt.log."
}

ensure_venv() {
    command -v "$PYTHON" >/dev/null || die "$PYTHON is not on PATH; install Python 3.11 (or set PYTHON=/path/to/python3.11)."
    [ -x "$VENV/bin/python" ] || { say "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
}

# uv installs the 3 GB of torch and TensorFlow in seconds from its cache, where pip takes
# minutes; pip itself only installs uv. /opt/wheels holds the CPU build of torch on machines
# that have one (PyPI's torch of the same version is the multi-GB CUDA build).
install_uv() {
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --retries 2 -c "$CONSTRAINTS" uv \
        >"$CACHE/pip.log" 2>&1 \
        || die "pip could not install uv (no network to PyPI?); see $CACHE/pip.log."
}

uv_install() {
    local links=()
    [ -d /opt/wheels ] && links=(--find-links /opt/wheels --index-strategy unsafe-best-match)
    "$VENV/bin/uv" pip install -q --python "$VENV/bin/python" -c "$CONSTRAINTS" "${links[@]}" "$@" \
        >"$CACHE/uv.log" 2>&1 \
        || die "uv could not install $* (no network to PyPI?); see $CACHE/uv.log."
}

# uv writes no .pyc files, and where PYTHONDONTWRITEBYTECODE is set (as on this project's
# machines) Python never writes them either: every process would compile TensorFlow from
# source again, 19 s instead of 6 s per `import tensorflow`, paid by each rank of each
# multi-process test. compileall skips files already compiled, so a .venv made before this
# step gets them too (uv's --compile-bytecode only compiles what it installs). One of torch's
# test helpers is Python 3.12 syntax (never imported here) and is skipped.
compile_bytecode() {
    local site
    site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
    "$VENV/bin/python" -m compileall -q -j 0 -x '/torch/testing/_internal/py312_intrinsics\.py$' \
        "$site" >"$CACHE/compileall.log" 2>&1 \
        || die "compiling the installed packages to bytecode failed; see $CACHE/compileall.log."
}

# Horovod 0.28.1 forces -std=c++14 for its torch op, but torch >= 2.1 headers need C++17.
write_cxx_wrapper() {
    local wrapper=$1/cxx17
    cat >"$wrapper" <<'EOF'
#!/usr/bin/env bash
args=()
for a in "$@"; do
    case "$a" in -std=c++14|-std=gnu++14|-std=c++11|-std=gnu++11) a=-std=c++17 ;; esac
    args+=("$a")
done
exec g++ "${args[@]}"
EOF
    chmod +x "$wrapper"
    echo "$wrapper"
}

# TF 2.21 moved xla_builder.h; Horovod only includes it for GPU XLA ops, which are compiled out.
write_tf_compat_headers() {
    local dir=$1/include
    mkdir -p "$dir/tensorflow/compiler/xla/client"
    echo '#include "xla/hlo/builder/xla_builder.h"' >"$dir/tensorflow/compiler/xla/client/xla_builder.h"
    echo "$dir"
}

build_horovod_wheel() {
    local wheel_dir=$1 work
    work=$(mktemp -d)
    local tf_include compat cxx
    tf_include=$("$VENV/bin/python" -c "import tensorflow as tf; print(tf.sysconfig.get_include())" 2>/dev/null)
    compat=$(write_tf_compat_headers "$work")
    cxx=$(write_cxx_wrapper "$work")
    say "compiling horovod $HOROVOD_VERSION (about 10-15 minutes on 2 cores; once per machine)"
    mkdir -p "$wheel_dir"
    env CXX="$cxx" CC=gcc \
        CMAKE_POLICY_VERSION_MINIMUM=3.5 \
        CXXFLAGS="-I$tf_include/external/highwayhash -I$tf_include/external/farmhash_archive/src -I$compat" \
        HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
        HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=gloo MAKEFLAGS="-j$(nproc)" \
        PATH="$VENV/bin:$PATH" \
        "$VENV/bin/python" -m pip wheel -v --no-deps --no-build-isolation --no-binary horovod \
        "horovod==$HOROVOD_VERSION" -w "$work/wheel" >"$CACHE/horovod-build.log" 2>&1 \
        || die "compiling horovod failed; the compiler output is in $CACHE/horovod-build.log."
    mv "$work"/wheel/horovod-*.whl "$wheel_dir/"
    rm -rf "$work"
}

ensure_horovod() {
    local key wheel_dir
    key="horovod-$HOROVOD_VERSION-py$("$VENV/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
    key="$key-torch$(pinned torch)-tf$(pinned tensorflow-cpu)-gloo-mpi"
    wheel_dir=$CACHE/wheels/$key
    local built=0
    if ! ls "$wheel_dir"/horovod-*.whl >/dev/null 2>&1; then
        build_horovod_wheel "$wheel_dir"
        built=1
    else
        say "reusing cached wheel $wheel_dir"
    fi
    uv_install --no-deps --reinstall "$wheel_dir"/horovod-*.whl
    # A wheel is checked once, when it is built; the check imports both frameworks (seconds).
    if [ "$built" = 1 ]; then
        check_build
    fi
}

check_build() {
    export TF_CPP_MIN_LOG_LEVEL=3
    "$VENV/bin/horovodrun" --check-build 2>"$CACHE/check-build.log" | tee "$CACHE/check-build.txt" >&2
    local missing
    missing=$(grep -E '\[ \] (TensorFlow|PyTorch|MPI|Gloo)$' "$CACHE/check-build.txt" || true)
    [ -z "$missing" ] || die "horovod was built without: $(echo "$missing" | tr '\n' ' ')"
}

main() {
    mkdir -p "$CACHE"
    local fingerprint
    fingerprint=$(setup_fingerprint)
    if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$fingerprint" ] && [ -x "$VENV/bin/horovodrun" ]; then
        return 0
    fi
    local started=$SECONDS
    ensure_system_packages
    ensure_venv
    say "installing Python packages (torch, tensorflow-cpu, tf_keras, mpi4py, pytest, ...)"
    # cmake and wheel compile Horovod; cloudpickle, psutil, pyyaml and packaging are Horovod's
    # own requirements (its wheel is installed without dependencies).
    install_uv
    uv_install -e "$ROOT[torch,tensorflow,test,examples]" cmake wheel setuptools cloudpickle psutil \
        pyyaml packaging -r "$DOCS_REQUIREMENTS"
    ensure_horovod
    compile_bytecode
    echo "$fingerprint" >"$STAMP"
    say "environment ready in $((SECONDS - started)) s"
}

main "$@"
