#!/usr/bin/env bash
# Installs the cluster image's software, one stage of docker/Dockerfile per call:
#
#   install_image.sh runtime     Debian packages every container needs: Python 3.11 with venv
#                                (unless the base image has it), Open MPI's libraries (the
#                                Horovod wheel links libmpi) and iproute2 (tc, shape_link.sh)
#   install_image.sh frameworks  a C compiler and Python's headers, then /opt/venv with torch
#                                (CPU build), Horovod with its PyTorch ops and their
#                                dependencies, from /tmp/wheels where it holds them
#   install_image.sh project     the project's wheel, built from /src into /dist
#
# Only the Debian packages the base image lacks are installed (apt-get then needs the network).
# /tmp/wheels (docker/wheels/ in the build context) may hold a torch wheel, a
# Horovod wheel and their dependencies, and constraints.txt (exact versions); without a Horovod
# wheel, Horovod is compiled here with PyTorch and Gloo only (about 3 minutes on 2 cores).
# WHEELS_ONLY=1: pip reads /tmp/wheels and no index, so the stage needs no network at all (to
# compile Horovod then, /tmp/wheels must hold its source archive and the cmake and cffi wheels).
# TensorFlow is not installed: no worker imports it.
set -euo pipefail

VENV=/opt/venv
WHEELS=/tmp/wheels
SRC=/src
DIST=/dist
PYTHON=${PYTHON:-python3.11}
HOROVOD_VERSION=0.28.1
# PyPI's torch is the multi-GB CUDA build; PyTorch's CPU index serves the same version.
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
# What Horovod's wheel needs at run time besides torch (it is installed with --no-deps), and
# numpy, without which torch warns at import.
RUNTIME_REQUIREMENTS=(cloudpickle psutil pyyaml packaging numpy)

say() { printf 'install_image: %s\n' "$*" >&2; }
die() { say "ERROR: $*"; exit 1; }

# The Debian packages among "$@" that are not installed, one per line.
missing_packages() {
    local pkg
    for pkg in "$@"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "ok installed" || echo "$pkg"
    done
}

apt_install() {
    local missing
    missing=$(missing_packages "$@")
    [ -z "$missing" ] && return 0
    say "installing Debian packages: $(echo $missing)"
    # shellcheck disable=SC2086 # one word per package
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
        --no-install-recommends $missing; } >/tmp/apt.log 2>&1 \
        || { tail -20 /tmp/apt.log >&2; die "apt-get could not install $(echo $missing) (no network to the Debian registry?)"; }
    rm -rf /var/lib/apt/lists/* /tmp/apt.log
}

# True when $PYTHON runs and can create a virtual environment with pip.
python_ready() {
    command -v "$PYTHON" >/dev/null && "$PYTHON" -c 'import ensurepip, venv' 2>/dev/null
}

python_headers_missing() {
    ! "$PYTHON" -c 'import os, sysconfig, sys
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'
}

# Version of $1 in the constraints file, e.g. "2.13.0" or "2.13.0+cpu".
pinned() { sed -n "s/^$1==//p" "$CONSTRAINTS" | head -1; }

runtime() {
    local packages=(libopenmpi3 iproute2)
    python_ready || packages+=(python3.11 python3.11-venv)
    apt_install "${packages[@]}"
    python_ready || die "$PYTHON with venv is still missing after installing python3.11-venv"
}

# Where pip looks: /tmp/wheels, and with WHEELS_ONLY nothing else.
pip_sources() {
    echo --find-links "$WHEELS"
    if [ -n "${WHEELS_ONLY:-}" ]; then echo --no-index; else echo --extra-index-url "$TORCH_CPU_INDEX"; fi
}

pip_install() {
    # shellcheck disable=SC2046 # pip_sources prints words without spaces inside
    "$VENV/bin/pip" install --no-cache-dir --disable-pip-version-check -q -c "$CONSTRAINTS" \
        $(pip_sources) "$@"
}

# Horovod from PyPI's source archive, PyTorch ops and Gloo only, when no wheel was given.
# Horovod 0.28.1 asks for C++14, which torch >= 2.1's headers refuse: a compiler wrapper turns
# that into C++17 (the same fix as scripts/setup_env.sh).
compile_horovod() {
    local work
    work=$(mktemp -d)
    apt_install g++ make
    pip_install cmake cffi  # cffi: Horovod's setup_requires
    printf '%s\n' '#!/usr/bin/env bash' 'args=()' 'for a in "$@"; do' \
        '  case "$a" in -std=c++14|-std=gnu++14|-std=c++11|-std=gnu++11) a=-std=c++17 ;; esac' \
        '  args+=("$a")' 'done' 'exec g++ "${args[@]}"' >"$work/cxx17"
    chmod +x "$work/cxx17"
    say "compiling horovod $HOROVOD_VERSION with PyTorch and Gloo (about 3 minutes on 2 cores)"
    env CXX="$work/cxx17" CC=gcc CMAKE_POLICY_VERSION_MINIMUM=3.5 PATH="$VENV/bin:$PATH" \
        HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
        HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=gloo \
        MAKEFLAGS="-j$(nproc)" \
        "$VENV/bin/pip" wheel --no-cache-dir --no-deps --no-build-isolation --no-binary horovod \
        $(pip_sources) "horovod==$HOROVOD_VERSION" -w "$WHEELS" >"$work/build.log" 2>&1 \
        || { tail -40 "$work/build.log" >&2; die "compiling horovod failed"; }
    rm -rf "$work"
}

frameworks() {
    local packages=(gcc libc6-dev)
    [ -n "${WHEELS_ONLY:-}" ] || packages+=(ca-certificates)
    python_headers_missing && packages+=(libpython3.11-dev)
    apt_install "${packages[@]}"
    "$PYTHON" -m venv "$VENV"
    # setuptools and wheel build the project's wheel (its C kernel) in the project stage.
    pip_install "torch==$(pinned torch)" "${RUNTIME_REQUIREMENTS[@]}" setuptools wheel
    if ! ls "$WHEELS"/horovod-"$HOROVOD_VERSION"-*.whl >/dev/null 2>&1; then
        compile_horovod
    fi
    "$VENV/bin/pip" install --no-cache-dir --disable-pip-version-check -q --no-deps \
        "$WHEELS"/horovod-"$HOROVOD_VERSION"-*.whl
    "$VENV/bin/python" -c 'import horovod.torch' \
        || die "horovod.torch does not import; was the Horovod wheel built for this torch?"
}

project() {
    "$VENV/bin/pip" wheel --no-cache-dir --disable-pip-version-check -q --no-deps \
        --no-build-isolation -w "$DIST" "$SRC"
}

# Constraints: the exact versions given with the wheels, else the project's pins.
if [ -f "$WHEELS/constraints.txt" ]; then
    CONSTRAINTS=$WHEELS/constraints.txt
else
    CONSTRAINTS=/tmp/constraints.txt
fi

case "${1:-}" in
    runtime | frameworks | project) "$1" ;;
    *) die "usage: install_image.sh runtime|frameworks|project" ;;
esac
