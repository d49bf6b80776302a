#!/usr/bin/env bash
# Build migd's packages from this repository:
#
#     packaging/build.sh deb|rpm|all OUTDIR
#
# deb: migd_<v>-<r>_<arch>.deb, migd-ep_<v>-<r>_all.deb, migd-ap_<v>-<r>_all.deb built with dpkg-deb
#      (Debian's own tool, in every Debian and Ubuntu base system). Build it ON the release it
#      is for (a trixie machine or chroot for trixie): the venv in it is made with that release's
#      python3 and its compiled wheels match that interpreter.
# rpm: migd-<v>-<r>.<arch>.rpm, migd-ep-<v>-<r>.noarch.rpm, migd-ap-... built with rpmbuild
#      (`apt-get install rpm` on Debian, native on EL). Build it with the interpreter the target
#      runs migd under (EL9: python3.11 from AppStream), named by PYTHON=/usr/bin/python3.11.
#
# Each package set is three packages, like HTCondor's own condor / condor-ep / condor-ap split:
#   migd     the daemon: a self-contained virtual environment in /opt/migd (the distributions'
#            pydantic/htcondor/pynvml are too old or missing), /usr/bin links, the systemd unit
#            and /etc/migd/migd.toml (a configuration file kept across upgrades);
#   migd-ep  execute-point HTCondor defaults:  /usr/share/condor/config.d/10-migd-execute.config
#   migd-ap  access-point HTCondor defaults:   /usr/share/condor/config.d/20-migd-access-point.config
# HTCondor reads /usr/share/condor/config.d before /etc/condor/config.d, so an admin's settings
# in /etc/condor/config.d override the packaged defaults and survive upgrades.
#
# Environment:
#   PYTHON          interpreter that builds the venv (default python3)
#   TARGET_PYTHON   where that interpreter lives on the target (default /usr/bin/python3 for
#                   the deb, /usr/bin/python3.X of PYTHON's version for the rpm)
#   PKG_RELEASE     package release/revision (default 1)
#   PKG_VERSION     override the version (default: pyproject.toml's)
#   DEB_COMPRESS    dpkg-deb compressor (default xz, the smallest; zstd builds ~60x faster)
#   RPM_PAYLOAD     rpm payload compression (default w19.zstdio, EL9's own; w3.zstdio is fast)
#   PIP_*           passed to pip (index, proxy, certificates)
# Nothing is installed on the build machine; everything is staged in a temporary directory.
set -euo pipefail

usage() { echo "usage: $0 deb|rpm|all OUTDIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
what=$1
out=$(mkdir -p "$2" && cd "$2" && pwd)
case "$what" in deb|rpm|all) ;; *) usage ;; esac

repo=$(cd "$(dirname "$0")/.." && pwd)
pkgdir="$repo/packaging"
python=${PYTHON:-python3}
release=${PKG_RELEASE:-1}
version=${PKG_VERSION:-$("$python" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' "$repo/pyproject.toml")}
pyver=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
pynext=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1] + 1}")')
work=$(mktemp -d "${TMPDIR:-/tmp}/migd-pkg.XXXXXX")
trap 'rm -rf "$work"' EXIT

log() { echo "[build.sh $(date +%H:%M:%S)] $*" >&2; }

# stage_tree TARGET_PYTHON -> $work/root: /opt/migd (venv) and every file of the three packages
stage_tree() {
    local target_python=$1 root="$work/root" venv="$work/root/opt/migd"
    rm -rf "$root"
    log "venv with $("$python" -V) for $target_python"
    "$python" -m venv "$venv"
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    # Build the wheel from a clean copy: no editable install, no stale build/ or egg-info.
    mkdir -p "$work/src" "$work/wheel"
    tar -C "$repo" --exclude=.git --exclude=.venv --exclude='*.egg-info' --exclude=build \
        --exclude=dist --exclude=__pycache__ --exclude='.*_cache' -cf - . | tar -C "$work/src" -xf -
    "$venv/bin/python" -m pip wheel --quiet --no-deps -w "$work/wheel" "$work/src"
    "$venv/bin/python" -m pip install --quiet --no-compile "$work"/wheel/migd-*.whl
    rm -f "$venv/.gitignore"  # Python 3.13 venvs hide themselves from git: not a package file
    "$venv/bin/migd" --print-example-config > "$work/migd.toml"
    "$venv/bin/migd" --config "$work/migd.toml" --check-config >/dev/null

    # Relocate: the venv was made in the staging directory; its scripts and pyvenv.cfg name that
    # path. Point them at /opt/migd and the interpreter at the target's (what dh-virtualenv does).
    local f
    for f in "$venv"/bin/* "$venv/pyvenv.cfg"; do
        if [ -f "$f" ] && [ ! -L "$f" ] && grep -Iq . "$f"; then
            sed -i "s#$venv#/opt/migd#g" "$f"
        fi
    done
    sed -i "s#^home = .*#home = $(dirname "$target_python")#" "$venv/pyvenv.cfg"
    rm -f "$venv/bin/python" "$venv/bin/python3" "$venv/bin/python$pyver"
    ln -s "$target_python" "$venv/bin/python"
    ln -s python "$venv/bin/python3"
    ln -s python "$venv/bin/python$pyver"
    find "$venv" -name __pycache__ -type d -prune -exec rm -rf {} +
    # Byte-compile with the final paths so that no process ever writes into /opt/migd.
    "$python" -W ignore::SyntaxWarning -m compileall -q -j0 -s "$root" -p / "$venv/lib" >/dev/null

    install -d "$root/usr/bin"
    for cmd in migd migctl migd-wrapper migd-run migd-release-hook; do
        ln -s "../../opt/migd/bin/$cmd" "$root/usr/bin/$cmd"  # relative: the same from a chroot
    done
    install -D -m 0644 "$repo/systemd/migd.service" "$root/usr/lib/systemd/system/migd.service"
    install -D -m 0644 "$work/migd.toml" "$root/etc/migd/migd.toml"
    install -d -m 0700 "$root/var/lib/migd"
    local doc="$root/usr/share/doc/migd"
    install -D -m 0644 "$repo/README.md" "$doc/README.md"
    for f in operations configuration wrapper htcondor-notes; do
        install -m 0644 "$repo/docs/$f.md" "$doc/$f.md"
    done
    install -m 0644 "$pkgdir/copyright" "$doc/copyright"
    install -D -m 0644 "$repo/condor_config/10-migd-execute.config" \
        "$root/usr/share/condor/config.d/10-migd-execute.config"
    install -D -m 0644 "$repo/condor_config/20-migd-access-point.config" \
        "$root/usr/share/condor/config.d/20-migd-access-point.config"
    install -D -m 0644 "$pkgdir/copyright" "$root/usr/share/doc/migd-ep/copyright"
    install -D -m 0644 "$pkgdir/copyright" "$root/usr/share/doc/migd-ap/copyright"
}

# deb_pkg NAME ARCH FILES... : build NAME from the listed paths of the staged tree
deb_pkg() {
    local name=$1 arch=$2; shift 2
    local d="$work/deb/$name" p
    rm -rf "$d"; mkdir -p "$d/DEBIAN"
    for p in "$@"; do
        mkdir -p "$d/$(dirname "$p")"
        cp -a "$work/root/$p" "$d/$p"
    done
    local size; size=$(du -sk --exclude=DEBIAN "$d" | cut -f1)
    sed -e "s/@VERSION@/$version-$release/g" -e "s/@ARCH@/$arch/g" -e "s/@SIZE@/$size/" \
        -e "s/@PYVER@/$pyver/g" -e "s/@PYNEXT@/$pynext/g" \
        "$pkgdir/debian/$name.control" > "$d/DEBIAN/control"
    for s in conffiles postinst prerm postrm; do
        if [ -f "$pkgdir/debian/$name.$s" ]; then
            install -m "$([ $s = conffiles ] && echo 0644 || echo 0755)" \
                "$pkgdir/debian/$name.$s" "$d/DEBIAN/$s"
        fi
    done
    (cd "$d" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z \
        | xargs -0r md5sum > DEBIAN/md5sums)
    local file="$out/${name}_${version}-${release}_${arch}.deb"
    dpkg-deb --root-owner-group -Z"${DEB_COMPRESS:-xz}" --build "$d" "$file" >/dev/null
    log "built $file ($(du -h "$file" | cut -f1))"
}

build_deb() {
    command -v dpkg-deb >/dev/null || { echo "dpkg-deb not found (Debian's dpkg)" >&2; exit 3; }
    local arch; arch=$(dpkg --print-architecture)
    stage_tree "${TARGET_PYTHON:-/usr/bin/python3}"
    deb_pkg migd "$arch" opt usr/bin usr/lib/systemd etc/migd var/lib/migd usr/share/doc/migd
    deb_pkg migd-ep all usr/share/condor/config.d/10-migd-execute.config usr/share/doc/migd-ep
    deb_pkg migd-ap all usr/share/condor/config.d/20-migd-access-point.config usr/share/doc/migd-ap
}

build_rpm() {
    command -v rpmbuild >/dev/null || { echo "rpmbuild not found (apt-get install rpm)" >&2; exit 3; }
    stage_tree "${TARGET_PYTHON:-/usr/bin/python$pyver}"
    local top="$work/rpmbuild"
    mkdir -p "$top"/{BUILD,RPMS,SOURCES,SPECS,SRPMS}
    rpmbuild -bb --quiet \
        --define "_topdir $top" \
        --define "_binary_payload ${RPM_PAYLOAD:-w19.zstdio}" \
        --define "migd_version $version" \
        --define "migd_release $release" \
        --define "migd_stage $work/root" \
        --define "migd_python python$pyver" \
        "$pkgdir/rpm/migd.spec"
    find "$top/RPMS" -name '*.rpm' -exec cp {} "$out/" \;
    log "built $(cd "$top/RPMS" && find . -name '*.rpm' -printf '%f ')"
}

case "$what" in
    deb) build_deb ;;
    rpm) build_rpm ;;
    all) build_deb; build_rpm ;;
esac
