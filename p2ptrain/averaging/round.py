"""What one averaging round is to its peers: the protocol they speak, its result, its failure, and the pure checks
of a formed group (every member decides them alike from the same gathered data)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Dict, Iterable, List, Sequence, Tuple

import torch

from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.averager import compute_schema_hash
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException
from hivemind.dht import DHTID

from p2ptrain.averaging.compression import SPARSE


@dataclass
class RoundResult:
    """What one all-reduce round did, as seen by one peer. Returned to the host process from the averager."""

    group_size: int
    """peers in the group, this one included"""
    bytes_sent: int = 0
    """payload bytes this peer sent: its parts to other reducers, averages back to other senders"""
    bytes_received: int = 0
    """payload bytes this peer received"""
    failed_fraction: float = 0.0
    """fraction of the vector whose reducer failed; those values stayed this peer's own"""
    gathered: Dict[str, Any] = field(default_factory=dict)
    """peer id (base58) -> the metadata that peer attached to this round (its samples, its outer step)"""
    allreduce_s: float = 0.0
    """seconds from the group's forming to the end of the all-reduce (the rest of a sync is matchmaking)"""
    phases: Dict[str, float] = field(default_factory=dict)
    """CPU seconds inside the all-reduce by kind of work (``ExactAllReduceRunner.clock``): encode, decode, checks,
    and ``write`` (the result copied into the shared buffers). The first three run on several threads while the
    wire carries other parts, so they overlap each other and the all-reduce's wall time"""
    mixed: bool = False
    """the group's members started from different global parameters (they averaged in different groups last round),
    so it averaged their stepped states (``outer.stepped_state_``: global parameters and outer momenta, in fp32)
    instead of their pseudo-gradients; the state buffers hold the group's mean"""
    group_id: bytes = b""
    """the group's id (butterfly rounds): a verifier asks the reducers for a sender's parts of it (replay check)"""

    def to_dict(self) -> dict:
        return asdict(self)


class IncompleteRoundError(AllreduceException):
    """A group formed but the round did not finish on every part (a member died or timed out mid-round)."""


class NotInRoundError(AllreduceException):
    """A member answered that it runs no round of this group: its matchmaking left as the leader counted it in."""


PROTOCOL_VERSION = 12
"""What peers must agree on beyond the codec to average together; bumped when a round's meaning changes.
2: digests of the global parameters are sha256 (they were blake2b). 3: join requests carry an admission token,
records about a peer are signed, parts are checked against the reducer's own norm. 4: reducers stream averages to
client-mode senders at once (no delayed results), and join requests carry the weight. 5: digests are xxh3-128
(records._digest_of). 6: a sender hangs up on a reducer once it holds every average of that reducer's range, and
the reducer holds the stream open until then (``ExactAllReduceRunner.rpc_aggregate_part``): with 5's peers each
side would wait for the other until a timeout. 7: mixing groups (p2ptrain/mixing.py): the matchmaking key carries
the round's cell, the gathered data ``mixing``, a group of different digests averages stepped states, and a peer
that leaves stores a leaving record (``PeerProgress.leaving``): with 6's peers the cells and the rounds differ.
8: sparse messages Rice-code their places (``sparse.py``): 7's 12-bit places do not decode as 8's. 9: a reducer's
signed answer carries its receipt (``audit.py``), which senders check and auditors recompute: 8's bare signature
does not parse as 9's. 10: a round's parts and averages go over p2ptrain's own stream (``part_stream.py``), not
hivemind's protobuf stream, which 10's peers refuse. 11: a round's part size comes from its members' measured link
rates (``part_size.py``): 10's peers would cut the default size and refuse 11's parts. 12: a receipt carries each
sender's sums under an aggregation that checks senders (``sender_scores.py``), which 11's peers do not know."""

SERVE_SENDERS_TIMEOUT_S = 15.0
"""how long a reducer that has its own result waits for the other senders to take their last averages"""

MAX_PEER_LIST_BYTES = 4096
"""room for the ids of the members that failed a round (about 80 of them; 60 excluded peers with their ends)"""


def schema_hash(averaged_tensors: Sequence[torch.Tensor], compression: str, sparse_k: int, aggregation: str,
                replay: bool = False) -> bytes:
    """What matchmaking compares: peers whose hashes differ never end up in one group. Of the pseudo-gradients'
    shapes alone: a peer that also keeps state buffers (mixing groups) still groups with one that does not (a round
    between them averages pseudo-gradients, or repairs, as before)."""
    schema = [compute_schema_hash(averaged_tensors).hex(), f"compression={compression}",
              f"protocol={PROTOCOL_VERSION}", *([f"sparse_k={sparse_k}"] if compression == SPARSE else []),
              *([f"aggregation={aggregation}"] if aggregation != "mean" else []),
              *(["replay"] if replay else [])]  # members of a replayed run gather claims and serve them
    return DHTID.generate(source=schema).to_bytes()


def user_gathered(serializer, gathered: bytes) -> dict:
    """What a member put in ``step(gather=...)``, from its serialized entry ({} if that is not a dict)."""
    try:
        entry = serializer.loads(serializer.loads(gathered)[2])
    except Exception:
        return {}
    return entry if isinstance(entry, dict) else {}


def read_gathered(serializer, group_info: GroupInfo) -> Tuple[Dict[str, Any], List[float]]:
    """The members' metadata by base58 id (the admission token removed: it has done its job), and their download
    bandwidths in the group's order (0 for a client-mode member, which reduces nothing)."""
    bandwidths, mode_ids, user_gathered_bytes = zip(*map(serializer.loads, group_info.gathered))
    gathered = {peer_id.to_base58(): without_admission(serializer.loads(data))
                for peer_id, data in zip(group_info.peer_ids, user_gathered_bytes)}
    modes = tuple(map(AveragingMode, mode_ids))
    return gathered, [bandwidth if mode != AveragingMode.CLIENT else 0.0 for bandwidth, mode in zip(bandwidths, modes)]


def nobody_contributes(serializer, group_info: GroupInfo) -> bool:
    """Whether every member of the group weighs 0 (newcomers joining a round in progress, peers whose training
    diverged): such a group has no pseudo-gradient to average. A member that sent no weight counts."""
    weights = [user_gathered(serializer, gathered).get("weight", 1.0) for gathered in group_info.gathered]
    return all(isinstance(w, (int, float)) and w == 0 for w in weights)


def mixes_states(gathered: Dict[str, Any], keeps_state: bool) -> bool:
    """Whether this group averages its members' stepped states rather than their pseudo-gradients: when they
    started from different global parameters (their digests differ) and every one of them keeps the state
    buffers (says ``mixing`` in its join data; ``keeps_state``: this peer does). Every member decides alike from the
    same gathered data."""
    entries = list(gathered.values())
    if not keeps_state or not all(isinstance(e, dict) and e.get("mixing") is True for e in entries):
        return False
    return len({e.get("digest") for e in entries}) > 1


def claimed_weights(group_info: GroupInfo, gathered: Dict[str, Any]) -> List[float]:
    """Each member's gathered weight (its samples), in the group's order: 0 where it sent none that is a number at
    least 0, 1 where it sent no metadata."""
    weights = []
    for peer in group_info.peer_ids:
        weight = gathered.get(peer.to_base58(), {})
        weight = weight.get("weight", 1.0) if isinstance(weight, dict) else 1.0
        weights.append(float(weight) if isinstance(weight, (int, float)) and weight >= 0 else 0.0)
    return weights


def own_norm_scale(mine: Any) -> float:
    """The norm scale this peer put in its gathered data (at least 1, finite; 1 without one)."""
    scale = mine.get("norm_scale", 1.0) if isinstance(mine, dict) else 1.0
    return float(scale) if isinstance(scale, (int, float)) and 1.0 <= scale < float("inf") else 1.0


def joined_ids(peer_ids: Iterable[str], max_bytes: int = MAX_PEER_LIST_BYTES - 1) -> bytes:
    """Comma-separated ids that fit in ``max_bytes`` (the ones that do not are left out whole)."""
    joined = b""
    for peer in peer_ids:
        item = (b"," if joined else b"") + peer.encode("ascii")
        if len(joined) + len(item) > max_bytes:
            break
        joined += item
    return joined


def split_ids(joined: bytes) -> list:
    """The ids ``joined_ids`` joined."""
    return [peer for peer in joined.decode("ascii", "replace").split(",") if peer]


def without_admission(gathered: Any) -> Any:
    """A member's gathered metadata as the host sees it: the admission token has done its job."""
    if isinstance(gathered, dict):
        gathered.pop("admission", None)
    return gathered
