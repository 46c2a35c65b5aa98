"""Who may average with this peer: holders of the swarm key that are not excluded, in groups with something to add."""

from __future__ import annotations

from typing import Callable, Optional

from hivemind.averaging.control import StepControl
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import PeerID
from hivemind.utils import get_logger

from p2ptrain.averaging.bans import Bans
from p2ptrain.averaging.round import nobody_contributes, user_gathered
from p2ptrain.security import SwarmAuth

logger = get_logger(__name__)


class Admission:
    """Checks a join request or a formed group (averager process) against the swarm key's rule (``auth``) and the
    exclusions (``bans``); a member it refuses is excluded through ``ban``. ``serializer`` reads the gathered data."""

    def __init__(self, auth: SwarmAuth, bans: Bans, serializer, ban: Callable[[PeerID, str], None]) -> None:
        self._auth, self._bans, self._serializer, self._ban = auth, bans, serializer, ban

    def refusal(self, peer: PeerID, gathered: bytes) -> str:
        """Why ``peer``, which sent ``gathered`` (its join request's or its group entry's), may not average with us;
        an empty string if it may."""
        if self._bans.is_banned(peer):
            return f"it is excluded ({self._bans.reason(peer)})"
        if not self._auth.admits(peer, user_gathered(self._serializer, gathered).get("admission")):
            return "it does not hold this swarm's key (--swarm-key)"
        return ""

    def check_members(self, group_info: GroupInfo, me: PeerID, step: Optional[StepControl] = None) -> None:
        """A leader we do not know may have put anyone in the group: every member must be admitted by us too. And it
        relays what each member sent in its join request: ours (``step``'s) must come back as we sent it. A leader
        that changed it (our weight, our steps: the sender check scales our norm by them) cannot be named by us
        (hivemind's group does not say who led it); we leave the group."""
        if step is not None and me in group_info.peer_ids and \
                group_info.gathered[group_info.peer_ids.index(me)] != step.data_for_gather:
            logger.warning(f"left a group of {len(group_info.peer_ids)} whose leader changed what this peer sent in "
                           "its join request (its weight, steps or token)")
            raise MatchmakingException("the group's leader changed this peer's join data")
        for peer_id, gathered in zip(group_info.peer_ids, group_info.gathered):
            refusal = self.refusal(peer_id, gathered) if peer_id != me else ""
            if refusal:
                logger.warning(f"left a group with peer {peer_id} in it: {refusal}")
                self._ban(peer_id, refusal)
                raise MatchmakingException(f"the group holds peer {peer_id}, which we refuse: {refusal}")

    def check_contributors(self, group_info: GroupInfo) -> None:
        """A group whose members all weigh 0 (newcomers joining a round in progress, peers whose training diverged)
        has no pseudo-gradient to average: running it would commit an outer step the swarm never took. Every member
        sees the same gathered weights, so all of them leave it alike. A member that sent no weight counts."""
        if nobody_contributes(self._serializer, group_info):
            logger.info(f"left a group of {len(group_info.gathered)} in which nobody has a pseudo-gradient to add "
                        "(all weigh 0)")
            raise MatchmakingException("every member of the group has weight 0: nothing to average")
