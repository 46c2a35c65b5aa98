"""Streaming DiLoCo's plan: which tensors make up each fragment, and at which inner step of a phase each fragment's
round starts and is applied. Plain values: no torch (the config checks a schedule with it), no network.

The parameters (in the model's order, so a fragment is a run of consecutive layers) are cut into F fragments of
about equal size. In every inner phase of H steps, fragment p's pseudo-gradient is taken at in-phase step
``launch(p) = (p + 1) * H // F - tau`` and its round runs while training goes on; its average is applied ``tau``
steps later, at ``apply(p) = (p + 1) * H // F``. So the rounds are staggered across the phase (a peer sends about
1/F of the parameters at a time: the peak bandwidth drops by about F), the last fragment is applied at the phase's
end (where ``outer_step`` moves on, as with the blocking sync: every fragment is then at the new outer step), and
at most one round is in flight at a time (``tau < H // F``). F = 1 and tau = 0 is the blocking sync.

Applying fragment p's average (Streaming DiLoCo, Douillard et al. 2025): the outer optimizer steps fragment p's
global parameters with the group's average, and the model's own values of the fragment, which trained on for tau
steps since its pseudo-gradient was taken, are merged with the new global values:
``local = alpha * local + (1 - alpha) * global`` (``outer.merge_``). alpha = 0 drops those tau steps' local progress on
the fragment (torchft's only choice); the paper mixes with alpha = 0.5 (its mixing factor), the default here. With
tau = 0 there is no local progress to keep, so the fragment becomes the global values exactly, as in DiLoCo.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

DEFAULT_MERGE_ALPHA = 0.5
"""the Streaming DiLoCo paper's mixing factor"""


def split_fragments(sizes: Sequence[int], fragments: int) -> List[List[int]]:
    """Cut tensors (their sizes, in order) into ``fragments`` runs of consecutive tensors of about equal total size:
    each run ends at the tensor that takes the running total closest to its share. Every run holds at least one
    tensor, so ``fragments`` may not exceed the number of tensors."""
    if not 1 <= fragments <= len(sizes):
        raise ValueError(f"cannot cut {len(sizes)} tensors into {fragments} fragments: use 1 to {len(sizes)}")
    total, runs, start, running = sum(sizes), [], 0, 0
    for p in range(fragments - 1):
        goal = total * (p + 1) / fragments
        end = start + 1  # at least one tensor, and leave one for each fragment still to come
        running += sizes[start]
        while end < len(sizes) - (fragments - 1 - p) and abs(running + sizes[end] - goal) <= abs(running - goal):
            running += sizes[end]
            end += 1
        runs.append(list(range(start, end)))
        start = end
    runs.append(list(range(start, len(sizes))))
    return runs


@dataclass(frozen=True)
class FragmentPlan:
    """The fragments and their schedule in each inner phase of ``local_steps`` steps (see the module's docstring)."""

    local_steps: int
    """H"""
    tensors: List[List[int]]
    """fragment -> indices of its tensors (in the optimizer's parameter order)"""
    overlap_steps: int = 0
    """tau: inner steps between taking a fragment's pseudo-gradient and applying its average"""
    merge_alpha: float = DEFAULT_MERGE_ALPHA
    """the share of the model's own values kept when a fragment's average is applied (used when tau > 0)"""

    @classmethod
    def build(cls, sizes: Sequence[int], local_steps: int, fragments: int = 1, overlap_steps: int = 0,
              merge_alpha: float = DEFAULT_MERGE_ALPHA) -> "FragmentPlan":
        check_schedule(local_steps, fragments, overlap_steps, merge_alpha, len(sizes))
        return cls(local_steps, split_fragments(sizes, fragments), overlap_steps, merge_alpha)

    @property
    def fragments(self) -> int:
        return len(self.tensors)

    @property
    def streaming(self) -> bool:
        """Anything but the blocking sync of all parameters at the phase's end."""
        return self.fragments > 1 or self.overlap_steps > 0

    def apply_at(self, fragment: int) -> int:
        """The in-phase step (1..H) after which fragment ``fragment``'s average is applied."""
        return (fragment + 1) * self.local_steps // self.fragments

    def launch_at(self, fragment: int) -> int:
        """The in-phase step (1..H) after which fragment ``fragment``'s pseudo-gradient is taken and its round
        starts."""
        return self.apply_at(fragment) - self.overlap_steps

    def due(self, local_step: int, at) -> Optional[int]:
        """The fragment whose ``at`` (``launch_at`` or ``apply_at``) is ``local_step``'s place in its phase."""
        in_phase = (local_step - 1) % self.local_steps + 1  # 1..H: H is the phase's last step
        for fragment in range(self.fragments):
            if at(fragment) == in_phase:
                return fragment
        return None

    def committed(self, local_step: int) -> List[bool]:
        """Which fragments are at the next outer step already, ``local_step`` steps into the run (a phase's end
        counts as the next phase's start: none). A peer that takes the state there goes on from these."""
        in_phase = local_step % self.local_steps
        return [0 < self.apply_at(p) <= in_phase for p in range(self.fragments)]

    def describe(self) -> str:
        """The schedule as the progress records carry it: "" for the blocking sync (every peer must agree)."""
        if not self.streaming:
            return ""
        return f"fragments={self.fragments} overlap={self.overlap_steps} alpha={self.merge_alpha:g}"


def check_schedule(local_steps: int, fragments: int, overlap_steps: int, merge_alpha: float,
                   num_tensors: Optional[int] = None) -> None:
    """Raise ValueError, in one line naming the fix, for a schedule that cannot run."""
    if fragments < 1:
        raise ValueError(f"fragments (--fragments) must be at least 1, got {fragments}")
    if fragments > local_steps:
        raise ValueError(f"fragments (--fragments {fragments}) may not exceed local_steps (--local-steps "
                         f"{local_steps}): each fragment is synced at a different inner step of the phase")
    if num_tensors is not None and fragments > num_tensors:
        raise ValueError(f"the model has {num_tensors} parameter tensors, too few for {fragments} fragments: use "
                         f"--fragments {num_tensors} or fewer")
    if overlap_steps < 0 or overlap_steps >= local_steps // fragments:
        raise ValueError(f"overlap_steps (--overlap-steps) must be from 0 to {local_steps // fragments - 1} with "
                         f"local_steps {local_steps} and {fragments} fragment(s) (local_steps // fragments - 1: one "
                         f"fragment's round ends before the next starts), got {overlap_steps}")
    if not 0.0 <= merge_alpha <= 1.0:
        raise ValueError(f"merge_alpha (--merge-alpha) must be between 0 and 1, got {merge_alpha}")

