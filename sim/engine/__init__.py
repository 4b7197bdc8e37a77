"""The engine loop that both executors drive, the objects a run is assembled from, and the bulk steps."""
