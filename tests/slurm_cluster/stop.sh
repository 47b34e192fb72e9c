#!/usr/bin/env bash
# Stop the daemons that start.sh started, each by the PID in its own pid file (never by
# name), waiting up to 15 s for each before SIGKILL. Safe to run when nothing is running.
set -u
RUN_DIR=/run/slurm-autosp-test

stop_pid_file() {  # $1 = pid file, $2 = label
  local f=$1 pid
  [ -s "$f" ] || { echo "$2: not running (no pid file)"; return 0; }
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid"
    for _ in $(seq 1 75); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid"; echo "$2: SIGKILLed $pid"
    else echo "$2: stopped $pid"; fi
  else
    echo "$2: pid $pid was not running"
  fi
  rm -f "$f"
}

stop_pid_file "$RUN_DIR/slurmd.pid" slurmd
stop_pid_file "$RUN_DIR/slurmctld.pid" slurmctld
stop_pid_file /run/munge/munged.pid munged
rm -f "$RUN_DIR/fingerprint"
