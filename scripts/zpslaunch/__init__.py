"""zpslaunch - the package behind scripts/zps-launch (start a zps fleet, supervise it, stop
it, report). Python 3 standard library only; the usage is in cli.py's docstring.

  cli        command line, fleet description, main
  proc       Proc (one slot of the fleet), exit codes, the signal exceptions
  cluster    cluster file read/write, free loopback ports
  commands   command templates, --curve keys
  launchers  local / ssh / slurm wrapping (ssh.py, slurm.py)
  process    start, signal, reap, stop processes (own process groups only)
  supervise  the supervision loop and restart policies, --before-stop
  report     summary table and summary.json
"""
