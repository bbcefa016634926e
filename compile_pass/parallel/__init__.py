"""Context parallelism: the sharded attention op (``context_parallel``), which chunks of the
sequence each rank holds (``shard_layout``), and what the ranks exchange (``halo_exchange``).
Importing the package registers its ops."""

from . import context_parallel  # noqa: F401
