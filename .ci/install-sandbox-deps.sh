#!/usr/bin/env bash
# Installs what the sandbox manager needs: bubblewrap, runc, util-linux tools and CRIU 4.x.
# Debian bookworm's CRIU 3.17 fails `criu check` on recent kernels (vDSO bounds), so CRIU is built from
# Debian trixie's source tarball. It is built with RUNDIR=/dev/shm: CRIU caches its kernel probes (~100-300 ms
# per dump or restore on a loaded host) only on a tmpfs, and /run is not one on these machines.
# Two small patches (CRIU_PATCH below): (1) no conntrack dump for a network namespace dumped empty
# (--empty-ns net, as runc and the sandbox backend do): it walked the host's whole conntrack hash, ~2/3 of a
# dump's CPU here; (2) Linux 6.16+ answers EOPNOTSUPP to SO_PASSCRED/SO_PASSSEC on inet sockets, which made
# every dump of a process holding a TCP or UDP socket fail: those options are off there, so skip them.
# Idempotent: every step is skipped when its result is already there.
set -euo pipefail

log() { echo "[install-sandbox-deps] $*" >&2; }
export DEBIAN_FRONTEND=noninteractive

RUNTIME_PKGS=(bubblewrap runc util-linux iproute2 procps iptables)
BUILD_PKGS=(build-essential pkg-config python3-protobuf uuid-dev libaio-dev libbsd-dev libcap-dev libdrm-dev
  libnet1-dev libnftables-dev libnl-3-dev libprotobuf-c-dev libprotobuf-dev protobuf-c-compiler
  protobuf-compiler libgnutls28-dev patch)
CRIU_PREFIX=/usr/local/sbin
BUILD_DIR=${CRIU_BUILD_DIR:-/var/cache/k3-criu-build}
TEMP_SOURCES=/etc/apt/sources.list.d/k3-trixie-src.sources

apt_updated=0
apt_install() {
  local missing=()
  for pkg in "$@"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ $apt_updated -eq 0 ]; then apt-get update -qq; apt_updated=1; fi
  log "apt-get install ${missing[*]}"
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

KDAT_RUNDIR=/dev/shm
PATCH_MARKER="Skipping conntrack of an empty netns"
criu_works() {
  command -v criu >/dev/null 2>&1 && criu check >/dev/null 2>&1 &&
    grep -aq "$KDAT_RUNDIR/criu.kdat" "$(command -v criu)" && grep -aq "$PATCH_MARKER" "$(command -v criu)"
}

apt_install "${RUNTIME_PKGS[@]}"

if criu_works; then
  log "criu $(criu --version | head -1) already passes 'criu check' (kdat cache in $KDAT_RUNDIR); skipping build"
  exit 0
fi

apt_install "${BUILD_PKGS[@]}"

cleanup_sources() { rm -f "$TEMP_SOURCES"; }
trap cleanup_sources EXIT

mkdir -p "$BUILD_DIR"
cd "$BUILD_DIR"
if ! ls criu_*.orig.tar.* >/dev/null 2>&1; then
  # A temporary deb-src entry for trixie, copied from the machine's own Debian entry with the suite changed.
  debian_uri=$(awk '/^URIs:/ && /debian\/?$/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  if [ -z "$debian_uri" ]; then
    log "no Debian entry in /etc/apt/sources.list.d/debian.sources to copy a deb-src line from"
    exit 1
  fi
  cat > "$TEMP_SOURCES" <<SRC
Types: deb-src
URIs: $debian_uri
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  apt-get update -qq
  # Only a deb-src entry exists for trixie, so `-t trixie` is refused: pin the 4.x version instead.
  criu_version=$(apt-cache showsrc criu | awk '/^Version: 4\./ {print $2}' | sort -V | tail -1)
  [ -n "$criu_version" ] || { log "no CRIU 4.x source package in trixie"; exit 1; }
  # The .dsc may 404 while the orig tarball still arrives; only the tarball is needed.
  apt-get source --download-only "criu=$criu_version" >/dev/null 2>&1 || true
  cleanup_sources
  apt-get update -qq || true
fi
tarball=$(ls criu_*.orig.tar.* 2>/dev/null | sort -V | tail -1 || true)
[ -n "$tarball" ] || { log "could not fetch the CRIU source tarball"; exit 1; }
src_dir=src-${tarball%.orig.tar.*}
[ -d "$src_dir" ] || { mkdir -p "$src_dir" && tar -xf "$tarball" --strip-components=1 -C "$src_dir"; }
if ! grep -q "$PATCH_MARKER" "$src_dir/criu/net.c"; then
  patch -d "$src_dir" -p1 <<'CRIU_PATCH'
--- a/criu/net.c
+++ b/criu/net.c
@@ -2859,9 +2859,11 @@
 		pr_err("Unable to dump more than one netns if the --emptyns is set\n");
 		ret = -1;
 	}
-	if (!ret)
+	if (opts.empty_ns & CLONE_NEWNET)
+		pr_info("Skipping conntrack of an empty netns\n");
+	else if (!ret)
 		ret = dump_nf_ct(fds, CR_FD_NETNF_CT);
-	if (!ret)
+	if (!ret && !(opts.empty_ns & CLONE_NEWNET))
 		ret = dump_nf_ct(fds, CR_FD_NETNF_EXP);
 
 out:
--- a/criu/sockets.c
+++ b/criu/sockets.c
@@ -676,13 +676,20 @@
 	soe->so_reuseport = val ? true : false;
 	soe->has_so_reuseport = true;
 
-	ret |= dump_opt(sk, SOL_SOCKET, SO_PASSCRED, &val);
-	soe->has_so_passcred = true;
-	soe->so_passcred = val ? true : false;
+	/* Linux 6.16+ rejects these on sockets other than unix and netlink: they are off there. */
+	if (getsockopt(sk, SOL_SOCKET, SO_PASSCRED, &val, &(socklen_t){ sizeof(val) }) == 0) {
+		soe->has_so_passcred = true;
+		soe->so_passcred = val ? true : false;
+	} else if (errno != EOPNOTSUPP) {
+		ret |= dump_opt(sk, SOL_SOCKET, SO_PASSCRED, &val);
+	}
 
-	ret |= dump_opt(sk, SOL_SOCKET, SO_PASSSEC, &val);
-	soe->has_so_passsec = true;
-	soe->so_passsec = val ? true : false;
+	if (getsockopt(sk, SOL_SOCKET, SO_PASSSEC, &val, &(socklen_t){ sizeof(val) }) == 0) {
+		soe->has_so_passsec = true;
+		soe->so_passsec = val ? true : false;
+	} else if (errno != EOPNOTSUPP) {
+		ret |= dump_opt(sk, SOL_SOCKET, SO_PASSSEC, &val);
+	}
 
 	ret |= dump_opt(sk, SOL_SOCKET, SO_DONTROUTE, &val);
 	soe->has_so_dontroute = true;
CRIU_PATCH
fi
log "building CRIU from $tarball"
rm -f "$src_dir/criu/kerndat.o"  # KDAT_RUNDIR is compiled in there
make -C "$src_dir" -j"$(nproc)" RUNDIR="$KDAT_RUNDIR" criu >/dev/null
install -m 0755 "$src_dir/criu/criu" "$CRIU_PREFIX/criu"
hash -r
if criu_works; then
  log "criu $(criu --version | head -1) installed; 'criu check' passes"
else
  log "criu built but 'criu check' fails on this kernel: CRIU backend tests will skip"
  criu check || true
fi
