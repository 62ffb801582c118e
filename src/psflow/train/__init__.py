"""Training: the worker-side step (pull -> forward/backward -> push) and its modes."""
