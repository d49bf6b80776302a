"""migd: let HTCondor jobs share NVIDIA GPUs through dynamic MIG partitions and MPS."""

__version__ = "0.1.0"
