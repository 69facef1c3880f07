#!/usr/bin/env bash
# Build the CPU image and run rl in it: `rl --dry-run`, then 3 steps of the quickstart's configs on the image's tiny
# model. Prints the builder, the build's time, the image's size and the run's summary line.
#   bash scripts/image-check.sh               build with docker (a daemon answering), podman or buildah
#   bash scripts/image-check.sh --builder     only say which builder would build (exit 3: none)
# The torch 2.13.0+cpu wheel goes into ./wheels from UV_FIND_LINKS or PIP_FIND_LINKS where it is not there.
# Where the base image (BASE_IMAGE, default python:3.11-slim) is neither here nor pullable (no registry reachable),
# a stand-in is made from Debian's packages with debootstrap (root).
set -euo pipefail
cd "$(dirname "$0")/.."
IMAGE="${IMAGE:-localhost/rl:cpu}"
BASE_IMAGE="${BASE_IMAGE:-python:3.11-slim}"

builder() {
  if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then echo docker
  elif command -v podman >/dev/null 2>&1; then echo podman
  elif command -v buildah >/dev/null 2>&1; then echo buildah
  else return 3
  fi
}

if [ "${1:-}" = --builder ]; then
  builder || { echo "image-check: no image builder (docker with a daemon, podman or buildah)" >&2; exit 3; }
  exit 0
elif [ -n "${1:-}" ]; then
  echo "image-check: unknown argument '$1' (expected --builder or nothing)" >&2; exit 2
fi
B=$(builder) || { echo "image-check: no image builder (docker with a daemon, podman or buildah)" >&2; exit 3; }
echo "image-check: builder $B ($($B --version | head -1))"

# The CPU torch wheel, which no package index serves, in the build context.
if ! ls wheels/torch-*+cpu*.whl >/dev/null 2>&1; then
  folder="${UV_FIND_LINKS:-${PIP_FIND_LINKS:-}}"
  wheel=$(ls "$folder"/torch-2.13.0+cpu*.whl 2>/dev/null | sort | tail -1 || true)
  [ -n "$wheel" ] || { echo "image-check: put the torch 2.13.0+cpu wheel in ./wheels (none in '$folder')" >&2; exit 1; }
  mkdir -p wheels && cp "$wheel" wheels/
fi

has_image() {
  case "$B" in
    docker) docker image inspect "$1" >/dev/null 2>&1 ;;
    *) $B images --quiet "$1" 2>/dev/null | grep -q . ;;
  esac
}

# A stand-in for python:3.11-slim made of Debian 12's packages (its python3 is 3.11), where no registry answers.
make_base() {
  [ "$(id -u)" = 0 ] && command -v debootstrap >/dev/null 2>&1 || {
    echo "image-check: $BASE_IMAGE is not here and cannot be pulled; as root with debootstrap installed this" \
         "script makes a stand-in, or name a mirror's image with BASE_IMAGE=..." >&2; exit 1; }
  local mirror rootfs
  mirror=$(cat /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null \
           | grep -E '^(URIs:|deb )' | grep -oE 'https?://[^ ]+/debian/?( |$)' | head -1 | tr -d ' ' || true)
  rootfs=$(mktemp -d /tmp/rl-base-XXXXXX)
  echo "image-check: making $BASE_IMAGE from Debian bookworm (${mirror:-deb.debian.org})"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,python3-dev,ca-certificates \
    bookworm "$rootfs" "${mirror:-http://deb.debian.org/debian}" >/dev/null
  rm -f "$rootfs"/usr/lib/python3.11/EXTERNALLY-MANAGED  # the official image has no such marker
  ln -sf /usr/bin/python3 "$rootfs/usr/local/bin/python"; ln -sf /usr/bin/pip3 "$rootfs/usr/local/bin/pip"
  cp /etc/ssl/certs/ca-certificates.crt "$rootfs/etc/ssl/certs/"  # the CAs this host trusts, its proxy's too
  case "$B" in
    docker) tar -C "$rootfs" -c . | docker import --change "ENV SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt" \
              - "$BASE_IMAGE" >/dev/null ;;
    *) local c m
       c=$(buildah from scratch); m=$(buildah mount "$c")
       cp -a "$rootfs"/. "$m"/; buildah umount "$c" >/dev/null
       buildah config --env SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt "$c"
       buildah commit --quiet "$c" "$BASE_IMAGE" >/dev/null; buildah rm "$c" >/dev/null ;;
  esac
  rm -rf "$rootfs"
}

if ! has_image "$BASE_IMAGE" && ! $B pull "$BASE_IMAGE" >/dev/null 2>&1; then
  make_base
fi

start=$(date +%s)
case "$B" in
  docker) docker build --network host -t "$IMAGE" . ;;
  podman) podman build --network host --pull=never -t "$IMAGE" . ;;
  buildah) buildah bud --isolation chroot --network host --pull-never -t "$IMAGE" . ;;
esac
built=$(( $(date +%s) - start ))

# rl in the image, its working directory /app: `in_image <rl arguments>`
in_image() {
  case "$B" in
    docker|podman) $B run --rm --network host --shm-size=2g "$IMAGE" "$@" ;;
    buildah) local c status=0
             c=$(buildah from --pull-never "$IMAGE")
             buildah run --isolation chroot --network host "$c" -- rl "$@" || status=$?
             buildah rm "$c" >/dev/null; return $status ;;
  esac
}

# The user the image runs as: never root (the Dockerfile's USER).
case "$B" in
  docker|podman) uid=$($B run --rm --entrypoint id "$IMAGE" -u) ;;
  buildah) c=$(buildah from --pull-never "$IMAGE"); uid=$(buildah run --isolation chroot "$c" -- id -u); buildah rm "$c" >/dev/null ;;
esac
[ "$uid" != 0 ] || { echo "image-check: the image runs as root" >&2; exit 1; }
echo "image-check: the image runs as uid $uid"

configs=(--trainer @ configs/reverse_text/train.toml --orchestrator @ configs/reverse_text/orch.toml
         --inference @ configs/reverse_text/infer.toml --model.name models/tiny --output-dir /tmp/rl-image-check)
in_image "${configs[@]}" --max-steps 3 --dry-run >/dev/null
echo "image-check: rl --dry-run in the image: ok"
start=$(date +%s)
log=$(mktemp)
in_image "${configs[@]}" --max-steps 3 2>&1 | tee "$log" | grep -E "^rl: (step|finished|failed)" || true
ran=$(( $(date +%s) - start ))
summary=$(grep "^rl: finished" "$log" || true)
rm -f "$log"
case "$B" in
  docker) size=$(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.2f GB", $1 / 1e9}') ;;
  *) size=$($B images --format '{{.Size}}' "$IMAGE" | head -1) ;;
esac
echo "image-check: $IMAGE built in ${built} s, ${size}; the 3-step run took ${ran} s"
[ -n "$summary" ] || { echo "image-check: the run in the image did not finish" >&2; exit 1; }
echo "image-check: $summary"
