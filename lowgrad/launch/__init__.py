"""Starting ranks and their communicators: N ranks as threads of one process, or one process per
GPU from a launcher's environment, with the rendezvous that carries NCCL's unique id between
processes. Imports the bottom layers, ``sr`` and both backends: the one layer that picks a backend by name."""
