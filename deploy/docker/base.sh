#!/usr/bin/env bash
# A local base image for builds without an image registry: Debian bookworm made by debootstrap from
# the Debian mirror, with the Dockerfile's OS_PACKAGES already in it (so the image build needs no apt
# and no network), imported with `docker import`. Prints the image name.
#
#   BASE=$(deploy/docker/base.sh)    # tokenmill-base:bookworm-<hash of suite, mirror and packages>
#
# Built once per machine: an image of that name in the engine's store is reused (docker rmi it, or
# make docker-clean, to rebuild). Needs root, debootstrap (installed with apt when missing) and about
# 650 MB. Variables: SUITE (bookworm), MIRROR (http://deb.debian.org/debian).
set -euo pipefail
cd "$(dirname "$0")/../.."
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}
DOCKER=${DOCKER:-docker}
packages=$(sed -n 's/^ARG OS_PACKAGES="\(.*\)"$/\1/p' Dockerfile)
[ -n "$packages" ] || { echo "base.sh: no ARG OS_PACKAGES=\"...\" line in the Dockerfile" >&2; exit 1; }
tag=$(echo "$SUITE $MIRROR $packages" | sha256sum | cut -c1-12)
image="tokenmill-base:$SUITE-$tag"
if $DOCKER image inspect "$image" >/dev/null 2>&1; then
  echo "base.sh: $image is here already" >&2
  echo "$image"
  exit 0
fi
if ! command -v debootstrap >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null
fi
root=$(mktemp -d /var/tmp/tokenmill-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "base.sh: debootstrap $SUITE with: $packages (a few minutes, once)" >&2
log="$root.log"
if ! debootstrap --variant=minbase --include="${packages// /,}" "$SUITE" "$root" "$MIRROR" >"$log" 2>&1; then
  tail -20 "$log" >&2
  exit 1
fi
rm -f "$log"
# what apt downloaded and indexed is not needed in the image
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/usr/share/doc "$root"/usr/share/man
tar -C "$root" -c . | $DOCKER import --change 'CMD ["/bin/bash"]' - "$image" >/dev/null
echo "base.sh: imported $image" >&2
echo "$image"
