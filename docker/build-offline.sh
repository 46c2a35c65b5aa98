#!/usr/bin/env bash
# Build the p2ptrain image where no image registry is reachable and containers cannot reach a package index:
#   1. a Debian base image made on this host with debootstrap (python3 + venv) and `docker import`ed, unless
#      it is already in the engine;
#   2. a wheelhouse of p2ptrain's dependencies made on this host with `pip wheel` (CPU torch included);
#   3. `docker build` of the same docker/Dockerfile that registry users build, with BASE_IMAGE set to (1) and
#      PIP_OFFLINE=1, so pip installs from the wheelhouse alone.
# Steps 1 and 2 are cached (the base image in the engine, the wheelhouse in $P2PTRAIN_DOCKER_CACHE), so a rebuild
# after a code change takes a minute.
#
# usage: docker/build-offline.sh [IMAGE_TAG]        (default p2ptrain:latest; needs root for debootstrap)
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
TAG="${1:-p2ptrain:latest}"
SUITE="${DEBIAN_SUITE:-bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
BASE="${BASE_IMAGE:-p2ptrain-base:$SUITE}"
CACHE="${P2PTRAIN_DOCKER_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/p2ptrain/docker}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"   # the CPU build; a GPU image is built from a registry (README)
WHEELS="$REPO/docker/wheels"

say() { echo "build-offline: $*" >&2; }
die() { say "error: $*"; exit 2; }

command -v docker >/dev/null || die "no docker client; install one (Debian: apt-get install docker.io)"
docker info >/dev/null 2>&1 || die "no Docker engine answers; start one (as root: dockerd &) and retry"

# --- 1. the base image -------------------------------------------------------------------------------------
if docker image inspect "$BASE" >/dev/null 2>&1; then
    say "base image $BASE: cached"
else
    [ "$(id -u)" = 0 ] || die "debootstrap needs root to make the base image $BASE; run as root or give BASE_IMAGE"
    command -v debootstrap >/dev/null || die "no debootstrap; install it (apt-get install debootstrap)"
    root="$(mktemp -d)"
    trap 'rm -rf "$root"' EXIT
    say "base image $BASE: debootstrap $SUITE from $MIRROR (a few minutes, once)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$root" "$MIRROR" \
        | while read -r line; do case "$line" in I:\ Retrieving*|I:\ Validating*) ;; *) say "  $line" ;; esac; done
    # nothing the image does not need at run time: apt's lists and caches, docs, man pages
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/* "$root"/usr/share/doc/* "$root"/usr/share/man/* \
        "$root"/usr/share/locale/*
    tar -C "$root" -c . | docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
    rm -rf "$root"
    trap - EXIT
    say "base image $BASE: $(docker image inspect -f '{{.Size}}' "$BASE" | awk '{printf "%.0f MB", $1/1e6}')"
fi

# --- 2. the wheelhouse -------------------------------------------------------------------------------------
mkdir -p "$CACHE/wheels"
say "wheelhouse: $CACHE/wheels (pip wheel; cached wheels are reused)"
# the image's Python must take these wheels: the host's minor version must match the base image's
host_py="$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
image_py="$(docker run --rm "$BASE" python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
[ "$host_py" = "$image_py" ] || die "host Python $host_py != image Python $image_py: the wheels would not fit; \
run this with a python3 $image_py, or set BASE_IMAGE to an image with Python $host_py"
# build dependencies too: the Dockerfile installs p2ptrain from source, offline
# (pip warns about each index folder of this host's pip.conf that lacks a package: noise, filtered)
python3 -m pip wheel --quiet --find-links "$CACHE/wheels" --wheel-dir "$CACHE/wheels" \
    "$TORCH_SPEC" "$REPO" setuptools wheel 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2
rm -f "$CACHE"/wheels/p2ptrain-*.whl   # built from source in the image; a stale one must not win
# the build context sees docker/wheels (git-ignored); hard links cost no space when on the same filesystem
find "$WHEELS" -name '*.whl' -delete
cp -l "$CACHE"/wheels/*.whl "$WHEELS"/ 2>/dev/null || cp "$CACHE"/wheels/*.whl "$WHEELS"/
say "wheelhouse: $(ls "$WHEELS"/*.whl | wc -l) wheels, $(du -sh "$CACHE/wheels" | cut -f1)"

# --- 3. the image ------------------------------------------------------------------------------------------
say "docker build $TAG from $BASE, offline"
DOCKER_BUILDKIT=0 docker build --file "$REPO/docker/Dockerfile" --tag "$TAG" \
    --build-arg BASE_IMAGE="$BASE" --build-arg PIP_OFFLINE=1 --build-arg TORCH_SPEC="$TORCH_SPEC" "$REPO" 2>&1 | grep -E "^Step |^Successfully|rror" >&2
find "$WHEELS" -name '*.whl' -delete
say "image $TAG: $(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}'), \
$(docker run --rm "$TAG" --version)"
