# Shared helpers for scripts/setup (sourced, not executed).

# One short line per action, to stderr so callers can capture stdout.
say()  { printf '[setup] %s\n' "$*" >&2; }
skip() { printf '[setup] ok: %s\n' "$*" >&2; }
die()  { printf '[setup] ERROR: %s\n' "$*" >&2; exit 1; }
have() { command -v "$1" >/dev/null 2>&1; }

# Run as root directly, or through sudo when we are not root.
as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif have sudo; then sudo "$@"; else die "need root for: $*"; fi
}

# Atomically publish a file: write to "$dest.tmp.$$" elsewhere, then call this.
publish() { # publish TMPFILE DEST
  mkdir -p "$(dirname "$2")"
  mv -f "$1" "$2"
}
