# Sourced by scripts/test.sh after _venv.sh: a Python that this machine's Debian does not carry,
# taken from another Debian suite's own packages, in a root (a chroot) that debootstrap makes once.
# The root and the venvs inside it live under the cache like every venv, keyed by what they hold.
#
# debian_root SUITE PACKAGES: prints the root's folder, making it first (as root, with debootstrap,
#   installed with apt-get when missing). Where it cannot be made it prints why and returns 1.
# in_root ROOT COMMAND...: COMMAND inside ROOT, in this checkout (mounted at its own path), with
#   /proc, /sys, /dev, a /dev/shm of its own, and this machine's hosts file, resolver and CA
#   certificates (a proxy's included: pip reaches the registry as it does here). The mounts are
#   made in a private mount namespace: they end with the command, none is left behind, and the
#   root's own files stay as debootstrap made them.
# root_venv ROOT PYTHON NAME REQUIREMENTS...: make_venv inside ROOT, with ROOT's PYTHON; prints the
#   venv's python as ROOT sees it (for in_root).

debian_root() {
  local suite="$1" packages="$2" key root log include tool
  key=$({ echo "$suite"; cat "$packages"; } | sha256sum | cut -c1-12)
  root="$CACHE_DIR/root-$suite-$key"
  if [ "$(id -u)" != 0 ]; then
    echo "a Debian $suite root needs root (debootstrap, chroot, mounts); CI runs as root"
    return 1
  fi
  if [ -f "$root/.complete" ]; then
    echo "$root"
    return 0
  fi
  for tool in unshare chroot mount; do
    if ! command -v "$tool" >/dev/null; then
      echo "no $tool here (util-linux, coreutils)"
      return 1
    fi
  done
  if ! command -v debootstrap >/dev/null; then
    if ! command -v apt-get >/dev/null; then
      echo "debootstrap is not installed, and there is no apt-get to install it"
      return 1
    fi
    echo "[setup] apt-get install debootstrap (first run only)" >&2
    log=$(mktemp)
    if ! { apt-get update -q && DEBIAN_FRONTEND=noninteractive \
             apt-get install -y -q debootstrap; } >"$log" 2>&1; then
      tail -n 5 "$log" >&2
      rm -f "$log"
      echo "apt-get install -y debootstrap failed"
      return 1
    fi
    rm -f "$log"
  fi
  mkdir -p "$CACHE_DIR"
  exec 9>"$root.lock"  # two runs at once: the second waits for the first one's root
  flock 9
  if [ ! -f "$root/.complete" ]; then
    echo "[setup] debootstrap $suite into $root (first run only)" >&2
    rm -rf --one-file-system "$root"
    include=$(grep -v -e '^#' -e '^\s*$' "$packages" | tr '\n' ',' | sed 's/,$//')
    log=$(mktemp)
    if ! debootstrap --variant=minbase --include="$include" "$suite" "$root" >"$log" 2>&1; then
      tail -n 5 "$log" >&2
      rm -f "$log"
      echo "debootstrap --variant=minbase --include=$include $suite failed (Debian's $suite packages unreachable?)"
      return 1
    fi
    rm -f "$log"
    rm -f "$root"/var/cache/apt/archives/*.deb
    touch "$root/.complete"
  fi
  flock -u 9
  echo "$root"
}

in_root() {
  local root="$1"; shift
  unshare --mount --propagation private -- /bin/sh -euc '
    root=$1 here=$2
    shift 2
    mount --bind "$root" "$root"  # a mount of its own: unshare -m works inside (tests use it)
    mount --rbind /dev "$root/dev"
    mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs "$root/dev/shm"
    mount -t proc proc "$root/proc"
    mount --rbind /sys "$root/sys"
    mkdir -p "$root$here"
    mount --bind "$here" "$root$here"
    # gloo finds its address through the hostname; pip trusts what this machine trusts
    for file in /etc/hosts /etc/resolv.conf /etc/ssl/certs/ca-certificates.crt; do
      if [ ! -f "$file" ]; then
        continue
      elif [ -f "$root$file" ] && [ ! -L "$root$file" ]; then
        mount --bind -o ro "$(readlink -f "$file")" "$root$file"
      else  # a mount on a symlink would land where it points, outside the root: a copy instead
        rm -f "$root$file"
        cp -L "$file" "$root$file"
      fi
    done
    exec chroot "$root" /usr/bin/env -u TMPDIR HOME=/root \
      PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
      /bin/sh -c "cd \"\$0\" && exec \"\$@\"" "$here" "$@"
  ' in_root "$root" "$PWD" "$@"
}

root_venv() {
  local root="$1" python="$2" name="$3"; shift 3
  local key venv req
  key=$(cat "$@" | sha256sum | cut -c1-12)
  venv="/opt/xlaunch/$name-$key"
  if [ ! -f "$root$venv/.complete" ]; then
    echo "[setup] creating $venv in $root (first run only)" >&2
    rm -rf "$root$venv"
    in_root "$root" "$python" -m venv "$venv" >&2 || return 1
    in_root "$root" "$venv/bin/python" -m pip install -q --upgrade pip >&2 2>/dev/null || true
    for req in "$@"; do
      in_root_pip "$root" "$venv/bin/python" -r "$req" || return 1
    done
    touch "$root$venv/.complete"
  fi
  echo "$venv/bin/python"
}

# in_root_pip ROOT PYTHON ARGS...: pip_quiet inside ROOT.
in_root_pip() {
  local root="$1" py="$2"; shift 2
  { in_root "$root" "$py" -m pip install -q "$@" 2>&1; } \
    | { grep -v -e "is ignored: it is neither" -e "is ignored: it is either" -e "^\s*$" || true; } >&2
}
