"""Weight sync: the trainer's sharded weights -> HF-named flattened buckets -> every engine, every RL step.

sync.py       ``WeightSync`` (one push per step: transport choice, groups, versions) and ``sync_weights``
plan.py       who sends what: per-stage rows, buckets, flats, built from megatron's sharding metadata
gather.py     a pipeline stage gathers its buckets: the TP / EP shards sent point-to-point to its sender
transport.py  the trainer's side of the ``distributed`` / ``colocated`` / ``object_store`` transports
groups.py     the groups and shared buffers both sides join (the engines' receiver included)
"""
