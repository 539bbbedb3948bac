# apt_get_when_free WAIT ARGS...: `apt-get ARGS`, once apt's and dpkg's locks are free.
# A box that just booted runs apt-daily and unattended-upgrades, which hold these locks for
# minutes; `apt-get update` fails at once on a held lists lock (DPkg::Lock::Timeout covers
# dpkg's locks only). Waits up to WAIT seconds, saying so on stderr, then finishes a dpkg run
# that was interrupted ("dpkg was interrupted, you must manually run 'dpkg --configure -a'").
# apt and dpkg take fcntl(2) record locks, not flock(2): probed with F_GETLK, as apt would
# see them, without taking them. Prepended to apt commands by pyinfra_declared/apt.py.
apt_get_when_free() {
  awf_wait=$1
  shift
  awf_start=$(date +%s)
  awf_said=
  while awf_busy=$(python3 -c '
import fcntl, os, struct, sys
for path in sys.argv[1:]:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        continue
    want = struct.pack("hhqqi4x", fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
    got = struct.unpack("hhqqi4x", fcntl.fcntl(fd, fcntl.F_GETLK, want))
    os.close(fd)
    if got[0] != fcntl.F_UNLCK:
        print(f"{path} held by pid {got[4]}", end="; ")
' ${APT_WAIT_LOCKS:-/var/lib/dpkg/lock-frontend /var/lib/dpkg/lock /var/lib/apt/lists/lock /var/cache/apt/archives/lock}) && [ -n "$awf_busy" ]; do
    awf_waited=$(( $(date +%s) - awf_start ))
    if [ "$awf_waited" -ge "$awf_wait" ]; then
      echo "apt_get_when_free: apt is still busy after ${awf_waited} s (${awf_busy%; }): giving up" >&2
      return 1
    fi
    if [ -z "$awf_said" ]; then
      echo "apt_get_when_free: apt is busy (${awf_busy%; }): waiting up to ${awf_wait} s" >&2
      awf_said=1
    fi
    sleep 2
  done
  if [ -n "$awf_said" ]; then
    echo "apt_get_when_free: apt's locks are free after $(( $(date +%s) - awf_start )) s" >&2
  fi
  if [ -n "$(ls -A /var/lib/dpkg/updates 2>/dev/null)" ] || [ -n "$(dpkg --audit 2>/dev/null)" ]; then
    echo "apt_get_when_free: dpkg was interrupted: running dpkg --configure -a first" >&2
    # This also folds dpkg's journal (/var/lib/dpkg/updates) into its status, which apt needs. It
    # fails on a package killed mid-unpack ("very bad inconsistent state; you should reinstall
    # it"): that package is reinstalled below, then --configure -a runs again.
    awf_unconfigured=
    DEBIAN_FRONTEND=noninteractive dpkg --force-confdef --force-confold --configure -a ||
      awf_unconfigured=1
    # A package killed mid-unpack stays half-installed (reinstall required): reinstall it.
    awf_half=$(dpkg-query -W -f='${db:Status-Abbrev} ${binary:Package}\n' 2>/dev/null |
      awk '$1 ~ /^.H/ || $1 ~ /R$/ { print $2 }')
    if [ -n "$awf_half" ]; then
      echo "apt_get_when_free: reinstalling what dpkg left half-installed:" $awf_half >&2
      # shellcheck disable=SC2086  # one word per package
      DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout="$awf_wait" \
        -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold -y -q \
        install --fix-broken --reinstall $awf_half || return
    fi
    if [ -n "$awf_unconfigured" ]; then
      echo "apt_get_when_free: running dpkg --configure -a again, after the reinstall" >&2
      DEBIAN_FRONTEND=noninteractive dpkg --force-confdef --force-confold --configure -a || return
    fi
  fi
  DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout="$awf_wait" \
    -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold "$@"
}
