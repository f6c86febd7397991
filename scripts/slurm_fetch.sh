#!/usr/bin/env bash
# Fetch Debian's Slurm (slurmctld, slurmd, the client commands, plugins and the libraries they
# load) and unpack it into a cache directory, without installing anything: the Slurm
# test (tests/test_slurm.py) runs these binaries from there.
# Usage: scripts/slurm_fetch.sh [DIR]   (default ${OMNIPS_SLURM_CACHE:-~/.cache/omnips-slurm})
set -euo pipefail
DIR=${1:-${OMNIPS_SLURM_CACHE:-$HOME/.cache/omnips-slurm}}
PACKAGES=(slurmctld slurmd slurm-client slurm-wlm-basic-plugins libmunge2 libhwloc15 libjson-c5
          liblua5.1-0 liblz4-1 libnuma1 libyaml-0-2 libdbus-1-3 libreadline8)
if [ -x "$DIR/root/usr/sbin/slurmctld-wlm" ]; then echo "Slurm already in $DIR"; exit 0; fi
mkdir -p "$DIR/debs" "$DIR/root"
# apt-get download writes into the current directory; its sandbox user may not write there
download() { (cd "$DIR/debs" && apt-get download -o APT::Sandbox::User=root "${PACKAGES[@]}"); }
if ! download; then
    # a fresh machine (a CI container) may have no package lists yet; only root can fetch them
    [ "$(id -u)" = 0 ] || exit 1
    apt-get update -qq && download
fi
for deb in "$DIR"/debs/*.deb; do dpkg -x "$deb" "$DIR/root"; done
echo "Slurm unpacked in $DIR/root"
