"""The one acceptance rule of every lossless decoder: keep the draft up to its first disagreement with the
verifier, then take the verifier's own token there (paper 000 section 3.3 step 3; paper 002 Algorithm 1;
paper 003 section 2.1).

Invariant: the verifier's token at a position is the AR head's choice (greedy, or the position's exact sample
in test-time scaling, paper 000 section 3.4) given the tokens before it in the verified sequence. A draft token
that equals its verifier token was conditioned on a prefix of accepted tokens, so by induction every accepted
token, the bonus included, is the token greedy AR would write at that position given the committed prefix: the
answer is AR's, token for token, whatever the draft was. `ss`, `selfspec`, `selfspec-quad`, `jacobi`,
`jacobi-mr` and `tts`'s rollouts (speculative and lockstep) all commit through `accept`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Accepted:
    """What `accept` keeps: `agreed` leading draft tokens equal the verifier's, and `tokens`, the verifier's
    tokens to commit (those `agreed` and, when there is one, the bonus: the verifier's token right after)."""

    agreed: int
    tokens: list[int]

    @property
    def whole(self) -> bool:
        """Whether every verifier token agreed (no bonus: the next position is left to the next forward)."""
        return self.agreed == len(self.tokens)


def accept(draft: Sequence[int], targets: Sequence[int]) -> Accepted:
    """The longest prefix on which `draft` and the verifier's `targets` (same positions; targets may run one
    position past the draft) agree, plus the verifier's next token if it has one (module doc: the invariant)."""
    agreed = next((i for i, (d, t) in enumerate(zip(draft, targets, strict=False)) if d != t), len(draft))
    agreed = min(agreed, len(targets))
    return Accepted(agreed, list(targets[: agreed + 1]))
