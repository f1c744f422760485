"""The docs make no stale promises: every "not yet" and "TODO" in them is one reviewed as
still true of the code.

A sentence that says a feature is missing "yet" (or a ``TODO``/``FIXME`` note) goes stale the
day the feature ships, and no code block test notices (``docs/samplers.md`` said "``ups train``
does not resume from a checkpoint yet" long after it did). So each such sentence must be listed
in :data:`REVIEWED`, with why it is still true; a new one fails until it is reviewed (fix it, or
list it), and a listed one that is gone fails too, so the list stays the docs' own.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [
        *ROOT.glob("docs/*.md"),
        ROOT / "README.md",
        *ROOT.glob("packages/*/README.md"),
        *ROOT.glob("plugins/*/README.md"),
    ]
)
CLAIM = re.compile(
    r"\b(?:(?:not|no|n't|never|nothing)\b[^.;:]*?\byet\b|TODO|FIXME|XXX|coming soon|"
    r"not (?:yet )?(?:implemented|supported))",
    re.IGNORECASE,
)
"""A negation followed by "yet" in one clause, or a to-do note."""

REVIEWED: dict[str, tuple[str, ...]] = {
    # The state of a launched job, not a missing feature.
    "docs/launching.md": (
        "not yet running",
        # Vultr gives a machine nothing but its start-up script: a limit of the service.
        "no way yet to give it credentials",
    ),
    # Describes the checkpoint's fields and the sampler's resumed epoch.
    "docs/checkpoints.md": ("not taken yet",),
    "docs/fault-tolerance.md": ("not yet taken",),
    "docs/samplers.md": ("not yet trained on",),
    # A measurement page's list of ideas, not a claim about a feature; the GPU suite's results
    # (this and the next two: true until it runs on a GPU, then replace them with its results).
    "docs/benchmarks.md": ("Ideas not yet tried", "no GPU has run it yet"),
    # The schedule's rules that have not fired in a run.
    "docs/decisions.md": ("not fired yet",),
    # A hook's moment in the run, a folder made on first use, a resumed sampler's epoch.
    "docs/hooks.md": ("No step has been taken yet", "may not exist yet", "not yet taken"),
    # A comment in the example loop: the step's checkpoint is still to be written.
    "docs/own-loop.md": ("not saved at this step yet",),
}


def claims(page: Path) -> list[str]:
    """The page's sentences that match :data:`CLAIM` (a paragraph's lines joined)."""
    text = " ".join(page.read_text(encoding="utf-8").split())
    return [s for s in re.split(r"(?<=[.!?])\s+", text) if CLAIM.search(s)]


def reviewed(page: Path, claim: str) -> bool:
    return any(ok in claim for ok in REVIEWED.get(page.relative_to(ROOT).as_posix(), ()))


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.relative_to(ROOT).as_posix())
def test_every_not_yet_or_todo_in_the_docs_was_reviewed(page: Path) -> None:
    unreviewed = [claim for claim in claims(page) if not reviewed(page, claim)]
    assert not unreviewed, (
        f"{page.relative_to(ROOT)}: {unreviewed}: a statement that something is not done yet; "
        "if it shipped, fix the page; if it is still true, add it to REVIEWED with why"
    )


def test_every_reviewed_claim_is_still_in_its_page() -> None:
    for name, allowed in REVIEWED.items():
        found = claims(ROOT / name)
        for ok in allowed:
            assert any(ok in claim for claim in found), f"{name}: {ok!r} is gone; drop it"
