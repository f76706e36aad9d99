"""The contracts both backends implement, written once: the device (``backend``), the kernel
table (``kernels``, with the kernel sources read as data in ``kernel_source``) and the
communicator (``communicator``), with what every backend shares of them. Imports ``base`` and
``buffers``."""
