"""Sandbox manager: isolated agent sandboxes with pause/resume, live fork, snapshots and restore (§5.3.2)."""
