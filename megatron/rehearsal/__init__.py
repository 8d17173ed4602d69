"""Rehearse one rank of a large job on one machine (tools/rehearse.py, docs/rehearsal.md).

One real process runs as rank R of the config's whole world with torch's ``fake`` process-group
backend: the groups every rank would create, rank R's real shard sizes, the real engine for build,
steps, save (rank R's files) and load. ``fake_world`` joins the world and makes data;
``run`` measures one process; ``predict`` states what the analytic models say for that rank.
"""
