"""Retention: prune, archive and their destinations, and the sidecar's own retention loop."""
