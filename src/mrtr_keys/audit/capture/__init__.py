"""Capture: what producers queue and how it reaches a writer (the observer, the SDK's rejections, items, the
bounded queue, the sink, the shipper, the sidecar's sink)."""
