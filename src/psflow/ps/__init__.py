"""Parameter servers: placement (pure), the store (no I/O), the service and the worker-side client."""
