"""Checkpoint and resume without a framework: every rank's manager state and named arrays
(:class:`Rows`) in one directory that appears whole or not at all and loads at any world size
(docs/protocol.md, "Checkpoint and resume")."""
from __future__ import annotations

from lowgrad.checkpoint.rows import Rows
from lowgrad.checkpoint.store import Loaded, agree, latest, load, read, read_manifest, save, verify

__all__ = ["Rows", "Loaded", "save", "read", "load", "latest", "read_manifest", "verify", "agree"]
