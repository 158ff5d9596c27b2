"""The only code that touches llama.cpp: the ctypes wrapper over llama-cpp-python's
low-level API (:mod:`.backend`), the loaded build and its repack guard (:mod:`.runtime`),
which build suits a machine (:mod:`.buildconfig`, standard library only: the installer
imports it before anything else is installed), the memory estimate and layer placement
(:mod:`.memory`), RPC servers: handshake, devices, a server lost (:mod:`.rpc`),
child-process checks (:mod:`.child`) and the ``doctor`` report (:mod:`.doctor`).

This package's ``__init__`` imports nothing, so that ``scripts/install`` can import
:mod:`.buildconfig` on a machine without numpy or llama-cpp-python."""
