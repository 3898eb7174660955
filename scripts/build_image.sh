#!/usr/bin/env bash
# Builds the CPU image from ./Dockerfile with podman, on a machine that reaches only Debian's packages
# and PyPI (no container registry, no PyTorch index): `make image` / scripts/build_image.sh.
#   - the base (BASE_IMAGE) is Debian bookworm's minbase plus python3, built with debootstrap once and
#     kept in podman's storage as $LORAPLEX_IMAGE_BASE (delete that image to rebuild it);
#   - torch is the CPU wheel pip finds for `torch==2.13.0` here (its cache or a find-links dir), copied
#     into build/image-wheels/ (part of the build context) and installed as 2.13.0+cpu, so nothing
#     can pull another build of it; every other package comes from PyPI;
#   - layers are cached in podman's storage: a rebuild after a code change redoes only the last steps.
# Prints the image's name, size and build time, and fails if it is larger than LORAPLEX_IMAGE_MAX_MB
# (default 1500, i.e. 1.5 GB as podman counts: the uncompressed layers, 10^6 bytes a MB). Arguments
# are passed on to `podman build` (e.g. --build-arg CPU_KERNELS=0). Needs root (rootful podman);
# installs podman, runc and debootstrap from Debian's packages where missing. See ../shared/TOOLS.md for why each step looks as it does.
# Env: LORAPLEX_IMAGE (default localhost/loraplex:cpu), LORAPLEX_IMAGE_BASE, LORAPLEX_PIP_INDEX_URL,
#      LORAPLEX_IMAGE_MAX_MB,
#      DEBIAN_MIRROR (default: this machine's apt source, else deb.debian.org).
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE="${LORAPLEX_IMAGE:-localhost/loraplex:cpu}"
BASE="${LORAPLEX_IMAGE_BASE:-localhost/loraplex-base:bookworm-py311-2}"
TORCH_VERSION="2.13.0"
PIP_INDEX="${LORAPLEX_PIP_INDEX_URL:-https://pypi.org/simple}"
MAX_MB="${LORAPLEX_IMAGE_MAX_MB:-1500}"
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3

if ! command -v podman >/dev/null || ! command -v runc >/dev/null || ! command -v debootstrap >/dev/null; then
  apt-get update
  apt-get install -y --no-install-recommends -o DPkg::Lock::Timeout=600 podman runc debootstrap
fi

# The sandbox refuses setrlimit, so containers get no default ulimits; crun fails on hybrid cgroups.
# Replaced whole (renamed over), never truncated in place: a podman reading it meanwhile would run
# with default ulimits. One build at a time (a second waits, then finds its layers cached).
mkdir -p .tools/podman
exec 9>.tools/podman/build.lock
flock 9
printf '[containers]\ndefault_ulimits = []\n' >.tools/podman/.containers.conf.$$
mv -f .tools/podman/.containers.conf.$$ .tools/podman/containers.conf
export CONTAINERS_CONF="$PWD/.tools/podman/containers.conf"
P=(podman --runtime runc --cgroup-manager=cgroupfs)

started=$(date +%s)

if ! "${P[@]}" image exists "$BASE"; then
  mirror="${DEBIAN_MIRROR:-$(sed -n 's/^URIs: //p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)}"
  mirror="${mirror:-http://deb.debian.org/debian}"
  rootfs="$(mktemp -d /tmp/lpx-rootfs.XXXXXX)"
  trap 'rm -rf "$rootfs"' EXIT
  echo "building the base $BASE from $mirror (debootstrap)" >&2
  debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3 bookworm "$rootfs" "$mirror" \
    >/dev/null
  # Slim, as Debian's own slim images are: no package archives, lists, manuals or translations (the
  # copyright files stay); dpkg skips them in later installs too.
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/lib/apt/lists/* \
    "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/*
  find "$rootfs"/usr/share/doc -type f ! -name copyright -delete
  printf '%s\n' 'path-exclude /usr/share/doc/*' 'path-include /usr/share/doc/*/copyright' \
    'path-exclude /usr/share/man/*' 'path-exclude /usr/share/info/*' 'path-exclude /usr/share/locale/*' \
    >"$rootfs"/etc/dpkg/dpkg.cfg.d/slim
  tar -C "$rootfs" -c . | "${P[@]}" import --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
  rm -rf "$rootfs"
  trap - EXIT
fi

# The CPU torch wheel pip uses here for torch==2.13.0 (from its cache or find-links; a download where
# neither has it), for the base's Python 3.11.
mkdir -p build/image-wheels
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  --platform manylinux_2_28_x86_64 -d build/image-wheels "torch==$TORCH_VERSION"
if ! ls build/image-wheels/torch-"$TORCH_VERSION"+cpu-*.whl >/dev/null 2>&1; then
  echo "no CPU torch wheel found (got: $(ls build/image-wheels)); build with the public index instead:" \
       "docker build -t loraplex:cpu ." >&2
  exit 1
fi
find build/image-wheels -name '*.whl' ! -name "torch-$TORCH_VERSION+cpu-*" -delete

# pip in the build trusts this machine's CA bundle (mounted read-only, not installed into the image).
"${P[@]}" build --layers --network host -v /etc/ssl/certs:/host-certs:ro \
  --build-arg BASE_IMAGE="$BASE" \
  --build-arg TORCH_INDEX_URL="$PIP_INDEX" \
  --build-arg TORCH_VERSION="$TORCH_VERSION+cpu" \
  --build-arg PIP_CERT=/host-certs/ca-certificates.crt \
  --build-arg PIP_INDEX_URL="$PIP_INDEX" \
  "$@" -f Dockerfile -t "$IMAGE" . >&2

size=$("${P[@]}" image inspect --format '{{.Size}}' "$IMAGE")
echo "image $IMAGE: $((size / 1000000)) MB ($size bytes), built in $(($(date +%s) - started)) s"
if [ $((size / 1000000)) -gt "$MAX_MB" ]; then
  echo "image $IMAGE is $((size / 1000000)) MB, over the $MAX_MB MB limit (LORAPLEX_IMAGE_MAX_MB)" >&2
  exit 1
fi
