"""The engine: scheduler, requests, buckets, start-up, the k chooser, the graph canary."""
