"""The tensor-parallel rank group (group.py): process groups, broadcasts, all-reduce, rank devices.
The model's sharded layers are in pdserve/model/parallel.py; the rank processes and rank 0's step
messages belong to the engine (pdserve/engine/tp_ranks.py, tp_rank.py, tp_protocol.py).
"""
