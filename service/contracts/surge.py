"""The restart controller's surge in progress: one more pod asked for before a pod is
evicted, so that the restart never costs serving capacity.

The round that starts a surge writes this document on the Deployment (annotation
``embedserve/surge``); every later round, in the same process or in one started after a
crash, reads it and finishes the surge (evict the pod, restore the count) or undoes it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

SURGE_ANNOTATION = "embedserve/surge"

#: Whose count the surge raised: the Deployment's replicas when nothing else sets them, else
#: the floor of the autoscaler that does (an HPA's minReplicas, a KEDA ScaledObject's
#: minReplicaCount), so the autoscaler keeps deciding and never has a number to undo.
Owner = Literal["deployment", "hpa", "scaledobject"]


class Surge(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    pod: str  # the pod to evict once the surge pod is ready
    owner: Owner
    name: str  # the object whose count was raised
    before: int | None  # its count before the surge (None: the field was unset)
    surged: int  # the count the surge set
    ready_before: int  # ready serving pods, the one to evict included, when the surge began
    started_at: float  # Unix time
    phase: Literal["surge", "fallback"] = "surge"  # fallback: timed out, evict without it
    reason: str = ""  # why the pod must go
