#!/usr/bin/env bash
# Build migd's packages from this repository:
#
#     packaging/build.sh deb|rpm|all OUTDIR
#
# deb: migd_<v>-<r>~deb<N>_all.deb, migd-ep_..._all.deb, migd-ap_..._all.deb built with
#      dpkg-deb (Debian's own tool). Build it ON the release it is for (a trixie machine or
#      chroot for trixie, with python3-pydantic python3-structlog python3-prometheus-client
#      python3-psutil python3-venv installed: the man pages are made by running migd's parsers).
# rpm: migd-<v>-<r>.el9.noarch... built with rpmbuild (`apt-get install rpm` on Debian, native
#      on EL), for the interpreter the target runs migd under (EL9: python3.11 from AppStream),
#      named by PYTHON=/usr/bin/python3.11; its vendored wheels are that interpreter's.
#
# Each package set is three packages, like HTCondor's own condor / condor-ep / condor-ap split:
#   migd     the daemon: migd in /usr/lib/migd (a private directory) running on the
#            distribution's python3 and its packages (deb: condor's classad2/htcondor2,
#            pydantic, structlog, prometheus-client, psutil; only nvidia-ml-py is vendored),
#            the commands in /usr/bin, man pages, the systemd unit and a short
#            /etc/migd/migd.toml (a configuration file kept across upgrades);
#   migd-ep  execute-point HTCondor defaults:  /usr/share/condor/config.d/10-migd-execute.config
#   migd-ap  access-point HTCondor defaults:   /usr/share/condor/config.d/20-migd-access-point.config
# HTCondor reads /usr/share/condor/config.d before /etc/condor/config.d, so an admin's settings
# in /etc/condor/config.d override the packaged defaults and survive upgrades.
#
# Environment:
#   PYTHON          interpreter of the build (default python3); the rpm's vendored wheels are
#                   for its version
#   TARGET_PYTHON   the commands' interpreter on the target (default /usr/bin/python3 for
#                   the deb, /usr/bin/python3.X of PYTHON's version for the rpm)
#   MIGD_EXTRA_PATH rpm: where python3-condor's classad2/htcondor2 are (appended to sys.path;
#                   default /usr/lib64/python3.9/site-packages, EL9's system python)
#   RPM_DIST        rpm dist tag (default .el9)
#   PKG_MAINTAINER  Maintainer / Packager
#   PKG_RELEASE     package release/revision (default 1)
#   PKG_VERSION     override the version (default: pyproject.toml's)
#   DEB_COMPRESS    dpkg-deb compressor (default xz, the smallest; zstd builds ~60x faster)
#   RPM_PAYLOAD     rpm payload compression (default w19.zstdio, EL9's own; w3.zstdio is fast)
#   PIP_*           passed to pip (index, proxy, certificates)
# Nothing is installed on the build machine; everything is staged in a temporary directory.
# pip runs in a throwaway venv to fetch the vendored wheels (PIP_* reach it); none ships.
set -euo pipefail

usage() { echo "usage: $0 deb|rpm|all OUTDIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
what=$1
out=$(mkdir -p "$2" && cd "$2" && pwd)
case "$what" in deb|rpm|all) ;; *) usage ;; esac

repo=$(cd "$(dirname "$0")/.." && pwd)
pkgdir="$repo/packaging"
python=${PYTHON:-python3}
# 2: the first packages on the distribution's Python (1 was the /opt/migd venv); a
# revision must grow, since 0.1.0-1~deb13 would sort before the venv package's 0.1.0-1
release=${PKG_RELEASE:-2}
version=${PKG_VERSION:-$("$python" -c 'import sys, tomllib; print(tomllib.load(open(sys.argv[1], "rb"))["project"]["version"])' "$repo/pyproject.toml")}
# Each distribution's build has its own version: 0.1.0-2~deb13 (sorts before a later
# Debian revision 0.1.0-2), 0.1.0-2.el9. Taken from the build machine's os-release, since
# a package is built on the release it is for.
distrel=$(. /etc/os-release && echo "${VERSION_ID%%.*}")
debversion="$version-$release~deb$distrel"
rpmdist=${RPM_DIST:-.el9}
maintainer=${PKG_MAINTAINER:-"migd maintainers <maintainers@users.noreply.a-seed-cc931f27.example>"}
pyver=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
work=$(mktemp -d "${TMPDIR:-/tmp}/migd-pkg.XXXXXX")
trap 'rm -rf "$work"' EXIT

log() { echo "[build.sh $(date +%H:%M:%S)] $*" >&2; }

# stage_tree KIND -> $work/root: every file of the three packages.
# migd itself goes to a private directory, /usr/lib/migd (not a public module: nothing else
# imports it); the commands in /usr/bin are small scripts that put it first on sys.path.
# Its dependencies come from the distribution (deb: python3-pydantic, python3-structlog,
# python3-prometheus-client, python3-psutil and condor's own classad2/htcondor2); only what
# the distribution lacks is vendored into /usr/lib/migd with pip (on the build machine,
# never shipped): VENDOR_deb / VENDOR_rpm below. No pip, no setuptools, no PyPI htcondor.
VENDOR_deb="nvidia-ml-py>=12.535"
# EL9: python3.11 (AppStream) has none of these; HTCondor's python3-condor is built for the
# system python3 (3.9) and is found through MIGD_EXTRA_PATH (its classad2/htcondor2 use the
# stable ABI, abi3).
VENDOR_rpm="nvidia-ml-py>=12.535 pydantic>=2.6 structlog>=24.1 prometheus_client>=0.17 psutil>=5.9"
stage_tree() {
    local kind=$1 root="$work/root" lib="$work/root/usr/lib/migd"
    local target_python extra_path=""
    rm -rf "$root"
    if [ "$kind" = deb ]; then
        target_python=${TARGET_PYTHON:-/usr/bin/python3}
    else
        target_python=${TARGET_PYTHON:-/usr/bin/python$pyver}
        extra_path=${MIGD_EXTRA_PATH:-/usr/lib64/python3.9/site-packages}
    fi
    install -d "$lib"
    # migd's own code as it is in the tree (package data included); no wheel, no pip metadata
    tar -C "$repo" --exclude=__pycache__ --exclude='*.pyc' -cf - migd | tar -C "$lib" -xf -
    local vendor_var="VENDOR_$kind"
    log "vendoring into /usr/lib/migd: ${!vendor_var}"
    "$python" -m venv "$work/buildvenv"   # pip for the build only
    # shellcheck disable=SC2086  # the list is split on purpose
    "$work/buildvenv/bin/python" -m pip install --quiet --no-compile --only-binary=:all: \
        --target "$lib" ${!vendor_var}
    # what pip --target leaves besides the modules: nvidia-ml-py's top-level example.py
    rm -rf "$lib/bin" "$lib/example.py"
    # pip's own records (what installed it, hashes for `pip uninstall`): the package manager
    # owns these files; the licence and METADATA stay
    rm -f "$lib"/*.dist-info/{INSTALLER,REQUESTED,RECORD,direct_url.json}
    # a module is imported, not run: no '#!' line on a non-executable file (rpmlint)
    find "$lib" -path "$lib/migd" -prune -o -name '*.py' -type f ! -perm -u+x \
        -exec sed -i '1{/^#!/d}' {} +
    find "$lib" -name __pycache__ -type d -prune -exec rm -rf {} +
    find "$lib" -name '*.so' -exec chmod 0644 {} + -exec strip --strip-unneeded {} +

    install -d "$root/usr/bin"
    local cmd func
    for cmd in migd=migd.daemon.main:main migctl=migd.cli.migctl:main \
            migd-wrapper=migd.wrapper.entry:wrapper_main migd-run=migd.wrapper.entry:run_main \
            migd-release-hook=migd.wrapper.release_hook:main; do
        func=${cmd#*=}
        # -I (isolated): a job's PYTHONPATH or a user's site-packages must not change what
        # the wrapper or the root daemon imports; no `import re` (pip's template has it): a
        # job without a GPU pays for this script on every start (bench/wrapper_start.py).
        {
            echo "#!$target_python -I"
            echo "import sys"
            echo "sys.path.insert(0, \"/usr/lib/migd\")"
            [ -z "$extra_path" ] || echo "sys.path.append(\"$extra_path\")"
            echo "from ${func%:*} import ${func#*:}"
            echo "sys.exit(${func#*:}())"
        } > "$root/usr/bin/${cmd%%=*}"
        chmod 0755 "$root/usr/bin/${cmd%%=*}"
    done
    # the staged migd (its scripts name /usr/lib/migd, which is not there yet)
    local staged=(env PYTHONDONTWRITEBYTECODE=1 "PYTHONPATH=$lib${extra_path:+:$extra_path}" "$python" -c
        "import sys; from migd.daemon.main import main; sys.exit(main())")
    "${staged[@]}" --print-example-config > "$work/example.toml"
    "${staged[@]}" --config "$pkgdir/etc/migd.toml" --check-config >/dev/null

    local man="$root/usr/share/man"
    install -d "$man/man1" "$man/man8"
    export PYTHONDONTWRITEBYTECODE=1  # nothing of the build's runs may leave byte-code
    PYTHONPATH="$lib${extra_path:+:$extra_path}" "$python" "$pkgdir/manpage.py" migd \
        | gzip -9n > "$man/man8/migd.8.gz"
    for cmd in migctl migd-run; do
        PYTHONPATH="$lib" "$python" "$pkgdir/manpage.py" "$cmd" | gzip -9n > "$man/man1/$cmd.1.gz"
    done
    # migd-wrapper and migd-release-hook are run by HTCondor, never by a person: their
    # pages point at migd-run's and the docs.
    printf '.so man1/migd-run.1\n' | gzip -9n > "$man/man1/migd-wrapper.1.gz"
    printf '.so man1/migd-run.1\n' | gzip -9n > "$man/man1/migd-release-hook.1.gz"

    install -D -m 0644 "$repo/systemd/migd.service" "$root/usr/lib/systemd/system/migd.service"
    install -D -m 0644 "$pkgdir/etc/migd.toml" "$root/etc/migd/migd.toml"
    install -d -m 0700 "$root/var/lib/migd"  # the rpm owns it; the deb's postinst makes it
    local doc="$root/usr/share/doc/migd" f
    install -D -m 0644 "$repo/README.md" "$doc/README.md"
    # the docs the installed files and the man pages refer to
    for f in operations configuration wrapper htcondor-notes mps api; do
        install -m 0644 "$repo/docs/$f.md" "$doc/$f.md"
    done
    install -m 0644 "$work/example.toml" "$doc/migd.toml.example"
    install -D -m 0644 "$repo/contrib/grafana/migd.json" "$doc/contrib/grafana/migd.json"
    install -D -m 0644 "$repo/contrib/prometheus/migd-alerts.yml" \
        "$doc/contrib/prometheus/migd-alerts.yml"
    install -D -m 0644 "$repo/condor_config/10-migd-execute.config" \
        "$root/usr/share/condor/config.d/10-migd-execute.config"
    install -D -m 0644 "$repo/condor_config/20-migd-access-point.config" \
        "$root/usr/share/condor/config.d/20-migd-access-point.config"
    local p
    install -D -m 0644 "$pkgdir/debian/migd.lintian-overrides" \
        "$root/usr/share/lintian/overrides/migd"
    for p in migd migd-ep migd-ap; do
        install -D -m 0644 "$pkgdir/copyright" "$root/usr/share/doc/$p/copyright"
        if [ "$kind" = deb ]; then
            sed "s/@VERSION@/$debversion/" "$pkgdir/debian/changelog" | gzip -9n \
                > "$root/usr/share/doc/$p/changelog.Debian.gz"
        fi
    done
    find "$root" -name __pycache__ -type d -prune -exec rm -rf {} +
    if [ "$kind" = rpm ]; then
        # EL ships byte-code in the package; Debian compiles in the postinst (py3compile).
        "$python" -W ignore::SyntaxWarning -m compileall -q -j0 -s "$root" -p / "$lib" >/dev/null
    fi
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
    sed -e "s/@VERSION@/$debversion/g" -e "s/@ARCH@/$arch/g" -e "s/@SIZE@/$size/" \
        -e "s/@MAINTAINER@/$maintainer/" \
        "$pkgdir/debian/$name.control" > "$d/DEBIAN/control"
    for s in conffiles postinst prerm postrm; do
        if [ -f "$pkgdir/debian/$name.$s" ]; then
            install -m "$([ $s = conffiles ] && echo 0644 || echo 0755)" \
                "$pkgdir/debian/$name.$s" "$d/DEBIAN/$s"
        fi
    done
    (cd "$d" && find . -path ./DEBIAN -prune -o -type f -printf '%P\0' | sort -z \
        | xargs -0r md5sum > DEBIAN/md5sums)
    local file="$out/${name}_${debversion}_${arch}.deb"
    dpkg-deb --root-owner-group -Z"${DEB_COMPRESS:-xz}" --build "$d" "$file" >/dev/null
    log "built $file ($(du -h "$file" | cut -f1))"
}

build_deb() {
    command -v dpkg-deb >/dev/null || { echo "dpkg-deb not found (Debian's dpkg)" >&2; exit 3; }
    stage_tree deb
    # Architecture: all: no compiled code (nvidia-ml-py, the one vendored module, is Python)
    # not /var/lib/migd: the postinst makes it 0700 (lintian: a packaged 0700 directory)
    deb_pkg migd all usr/lib/migd usr/bin usr/lib/systemd etc/migd usr/share/doc/migd \
        usr/share/man usr/share/lintian
    deb_pkg migd-ep all usr/share/condor/config.d/10-migd-execute.config usr/share/doc/migd-ep
    deb_pkg migd-ap all usr/share/condor/config.d/20-migd-access-point.config usr/share/doc/migd-ap
}

build_rpm() {
    command -v rpmbuild >/dev/null || { echo "rpmbuild not found (apt-get install rpm)" >&2; exit 3; }
    stage_tree rpm
    rm -rf "$work/root/usr/share/lintian"  # Debian's
    local top="$work/rpmbuild"
    mkdir -p "$top"/{BUILD,RPMS,SOURCES,SPECS,SRPMS}
    rpmbuild -bb --quiet \
        --define "_topdir $top" \
        --define "_binary_payload ${RPM_PAYLOAD:-w19.zstdio}" \
        --define "migd_version $version" \
        --define "migd_release $release" \
        --define "dist $rpmdist" \
        --define "migd_maintainer $maintainer" \
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
