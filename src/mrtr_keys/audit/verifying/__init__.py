"""Verifying: the walk, what it trusts (checkpoints, prune cuts, archives, anchors) and where those records are
kept, and the archives' check."""
