"""Starting and watching ranks: deepy's launcher (local, Slurm, hostfile), the process spawner, the
rank-side entry point and guard, per-rank output and the failure report, exit codes."""
