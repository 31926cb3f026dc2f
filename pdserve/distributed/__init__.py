"""Tensor parallelism inside one worker: the rank group (group.py), rank 0's step messages to the
other ranks (protocol.py) and the rank processes (ranks.py). The model's sharded layers are in
pdserve/model/parallel.py; ModelRunner drives all of it.
"""
