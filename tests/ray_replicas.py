"""Replica specs for the Ray tests, imported by the replicas themselves (the test module puts
this folder on the cluster's PYTHONPATH): a scripted model that never stops and takes a fixed
time per token, so a test can act while a replica is mid-reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from chatcli.serve.ray_replica import ReplicaSpec


@dataclass(frozen=True)
class SlowScriptedSpec(ReplicaSpec):
    """Every byte equally likely, no end token, `delay` seconds a forward (~1/delay tok/s)."""

    delay: float = 0.02

    def load(self) -> tuple[Any, Any]:
        from fakes import uniform_bytes
        from serving import SlowModel, byte_tokenizer

        return SlowModel(uniform_bytes, self.delay, sequence_len=8192), byte_tokenizer()
