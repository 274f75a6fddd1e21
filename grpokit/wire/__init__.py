"""The weight-sync wire format and group, shared by the trainer's sender (``grpokit.engines``) and the rollout
server's receiver (``grpokit.server``): a bottom layer that imports neither.

Weight sync from the trainer to rollout servers over a ``torch.distributed`` group, without files.

The group is built *without* ``init_process_group`` (the trainer may already live in a torch.distributed world):
the trainer is rank 0 and hosts a ``TCPStore``; server ``i`` joins as rank ``i + 1``; the backend is
``ProcessGroupGloo`` on CPU or ``ProcessGroupNCCL`` when both ends hold their models on GPUs.

One sync = one ``POST /update_weights/`` per server carrying every bucket's metadata (names, dtypes, shapes,
byte offsets), then one broadcast per bucket of a flat ``uint8`` tensor of at most ``weight_sync_bucket_mb``
(a single tensor larger than that travels alone). Each tensor starts at a 16-byte aligned offset so that the
receiver can view the bytes as the tensor's dtype without a copy, then ``param.data.copy_`` it in place.

The metadata is validated whole before any broadcast (``wire.bodies`` and the served engine's ``check_weights``).
The receiver's rendezvous runs in a thread of its own under a server-side deadline (c10d can wait forever on a
store that accepts and never answers), and its lock covers only the swap of a finished group.
"""
