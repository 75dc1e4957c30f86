"""Slurm access (CLIs or pyslurm) and what the service reads from it: jobs, queue, partitions,
fleet, billing weights; requeue and reconciliation."""
