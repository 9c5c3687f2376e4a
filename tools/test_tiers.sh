#!/bin/sh
# `make test`'s two tiers side by side, both reported; exits 0 only if both passed.
#
#   sh tools/test_tiers.sh LEAN_LOG LEAN_COMMAND MAIN_PHASE...
#
# The main tier: its phases (MAIN_PHASE, each a shell command line) one after another, each run in this
# process group, every phase run even when an earlier one failed. The lean tier (LEAN_COMMAND, a shell
# command line) beside them, in a session and process group of its own, its output in LEAN_LOG and printed
# after the main tier's. It runs at the main tier's priority: where the kernel shares the CPU by session
# (autogroup scheduling) a nice value only ranks a process within its session, and where it does not (the
# tiers in a cpu cgroup, where autogroup does not apply) nice 10 left the lean tier about a tenth of a
# core's share, and its 2-attempt run overran its bounded wait (180 s; 16:54 for the tier instead of 3:59).
# Its session's own nice 10 (/proc/self/autogroup) starved it as well: beside the main tier's busy Ray
# sessions a module's fixture overran its 300 s in CI.
#
# SIGTERM, SIGINT (Ctrl-C reaches the whole foreground group) or SIGHUP to this script stops both: the
# running phase gets SIGTERM (no later phase starts), the lean tier's whole process group too, and both are
# waited for until empty; each pytest tears its fixtures down and ends every process of its session
# (tests/session_stop.py) first. POSIX sh (dash is /bin/sh on Debian: `kill -- -PGID` is an error there,
# `kill -TERM -PGID` is not).
set -u
lean_log=$1
lean_command=$2
shift 2

main=0
lean=0
pid=
lpid=

# The lean tier's exit status in `lean`, once its whole process group is gone.
wait_lean() {
  wait "$lpid" || lean=$?
  while kill -0 "-$lpid" 2>/dev/null; do sleep 0.2; done
  lpid=
}

stop() {
  [ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null
  [ -n "$lpid" ] && kill -TERM "-$lpid" 2>/dev/null
  [ -n "$pid" ] && wait "$pid"
  [ -n "$lpid" ] && wait_lean
  exit "$1"
}
trap 'stop 143' TERM
trap 'stop 130' INT
trap 'stop 129' HUP

# (setsid: not a group leader here, so it makes the session itself and keeps its pid, which is the group's.)
setsid sh -c "$lean_command" > "$lean_log" 2>&1 &
lpid=$!
# Each phase: `exec`, so the pid waited for (and stopped) is the phase's own command, not a shell around it.
for phase in "$@"; do
  sh -c "exec $phase" &
  pid=$!
  status=0
  wait "$pid" || status=$?
  pid=
  [ "$main" -eq 0 ] && main=$status
done
wait_lean
echo "== lean tier (its output, $lean_log):"
cat "$lean_log"
verdict() { if [ "$1" -eq 0 ]; then echo passed; else echo "FAILED (exit $1)"; fi; }
echo "make test: main tier $(verdict "$main"); lean tier (tests/tracking, tests/lean on pip install -e .) $(verdict "$lean")"
[ "$main" -eq 0 ] && [ "$lean" -eq 0 ]
