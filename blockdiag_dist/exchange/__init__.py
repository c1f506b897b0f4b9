"""K/V exchanges: deliver to each rank the key/value tokens its queries may see.

Every exchange takes the rank's packed K/V tokens ``kv_tok [Tq, F]`` (``F = Hkv * (D + Dv)``, keys and
values side by side, so one message carries both) and returns the rank's key buffer ``[Tk, F]``; the step
plan says which flat id each buffer row holds. Each is differentiable: its backward sends the gradients back
along the reverse route and accumulates them on the owner.

| mode        | forward                          | backward                      | moves                   |
| ----------- | -------------------------------- | ----------------------------- | ----------------------- |
| `local`     | nothing                          | nothing                       | 0 (nothing is needed)   |
| `allgather` | one all-gather of stacked [K;V]  | reduce-scatter                | every token everywhere  |
| `halo`      | send to rank+1, receive from -1  | the reverse, then index_add   | exactly the needed set  |
| `a2a`       | one all_to_all_single (splits)   | the reverse, then index_add   | exactly the needed set  |

Under non-reentrant activation checkpointing a region is recomputed, its forward collectives included, when its
backward first reads a tensor saved in it. Every exchange saves one and reads it before its backward collective
(the index of the rows it sends; the all-gather and the summary exchange an empty marker,
:mod:`.recompute`), so every rank recomputes before that collective, even a rank whose use of
what it received saved nothing (rows that see no key, a rank of padding only).
"""

from .a2a import a2a_kv
from .allgather import allgather_kv
from .halo import halo_kv
from .traffic import TrafficLog

__all__ = ["TrafficLog", "a2a_kv", "allgather_kv", "halo_kv"]
