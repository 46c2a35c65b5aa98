"""One round's receipts (audit.py, protocol 9), as the all-reduce runner keeps them.

As a reducer that signs (evidence.py): each input's commitment and weight, and the input itself, kept for the group's
auditors; each average goes out with its receipt, signed. As a sender: the commitment of each part we sent, to find
in every answer's receipt (an unsigned answer is refused where receipts are ``required``). Under an aggregation that
checks senders, every receipt's sums, ours and the other reducers', add up into the round's (``sums``,
sender_scores.py)."""

from __future__ import annotations

from typing import Dict, List, Optional

from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2, runtime_pb2

from p2ptrain.averaging.audit import check_receipt, receipt_message
from p2ptrain.averaging.evidence import AverageSigner, verified_receipt
from p2ptrain.averaging.robust import checks_senders
from p2ptrain.averaging.sender_scores import RoundSums
from p2ptrain.sender_check import RangeSums


class Receipts:
    def __init__(self, signer: Optional[AverageSigner], required: bool, weight_cap: float, aggregation: str,
                 senders: int, me: int = 0) -> None:
        self.signer, self._required = signer, required
        self._weight_cap, self._aggregation = weight_cap, aggregation
        self._commitments: Dict[tuple, tuple] = {}  # (part index, sender index) -> (commitment, weight)
        self.kept_inputs: Dict[tuple, runtime_pb2.Tensor] = {}  # (part index, sender index) -> the part as it came
        self.sent: Dict[tuple, bytes] = {}  # (reducer index, part index) -> our part's commitment
        self.signatures: Dict[int, bytes] = {}  # part index -> what our answer's ``peer_id`` field carries
        self.me = me  # our index among the reducers
        # (reducer index, part index) -> every sender's commitment in that part's receipt, ours and the others' (the
        # replay check fetches a sender's parts against them: replay_serving.py)
        self.commitments: Dict[tuple, List[bytes]] = {}
        self._reducer_keys: dict = {}  # the reducers' public keys checked so far (evidence._verify)
        # the senders' sums of every part whose receipt we checked or signed (the sender check), None without it
        self.sums: Optional[RoundSums] = RoundSums(senders) if checks_senders(aggregation) else None

    def keep(self, part_index: int, sender_index: int, message: runtime_pb2.Tensor, committed: bytes,
             weight: float) -> None:
        """As a reducer: what our receipt names of a sender's part, and what we show the group's auditors."""
        self.kept_inputs[(part_index, sender_index)] = message
        self._commitments[(part_index, sender_index)] = (committed, weight)

    def sign(self, group_id: bytes, part_index: int, average: runtime_pb2.Tensor, included: set,
             num_senders: int, sums: Optional[RangeSums] = None) -> None:
        """As a reducer with a signer: the receipt of what went into this average (the ``included`` senders'
        commitments and weights, and their ``sums`` under the sender check), signed with it."""
        entries = [self._commitments.get((part_index, i)) if i in included else None for i in range(num_senders)]
        receipt = receipt_message(entries, self._weight_cap, self._aggregation, sums)
        self.commitments[(self.me, part_index)] = list(receipt.commitments)
        self.signatures[part_index] = self.signer.sign(group_id, part_index, receipt.SerializeToString(), average)
        if self.sums is not None:
            self.sums.add(receipt)

    def problem(self, reducer: PeerID, group_id: bytes, reducer_index: int, part_index: int,
                message: averaging_pb2.AveragingData, senders: int, me: int, weight: float) -> str:
        """Why an answer's signature or receipt is refused (empty if it is not, or if it has none and none is
        required): the reducer must have signed it, and its receipt must hold our part as we sent it."""
        if not message.peer_id:
            return "an unsigned average (this swarm's reducers sign theirs)" if self._required else ""
        receipt = verified_receipt(reducer, group_id, part_index, message.peer_id, message.tensor_part,
                                   self._reducer_keys)
        if receipt is None:
            return "an average that it did not sign"
        problem = check_receipt(receipt, senders=senders, me=me, sent=self.sent.get((reducer_index, part_index), b""),
                                weight=weight, weight_cap=self._weight_cap, aggregation=self._aggregation)
        if not problem:
            self.commitments[(reducer_index, part_index)] = list(receipt.commitments)
        if not problem and self.sums is not None:
            self.sums.add(receipt)
        return problem
