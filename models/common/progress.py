"""Progress bars of the slow model steps (loading, drawing random weights, converting layouts)."""

from __future__ import annotations

from tqdm.auto import tqdm

# A progress bar shows once its step has run this long: a tiny model's millisecond build,
# conversion or load prints nothing.
PROGRESS_DELAY_S = 2.0


def progress_bar(items=None, *, desc: str, unit: str, enabled: bool = True, total=None):
    """`items` (or a bar counting to `total`, updated by hand) wrapped in a tqdm bar on stderr,
    shown after PROGRESS_DELAY_S seconds (never when `enabled` is False)."""
    items = None if items is None else list(items)
    return tqdm(
        items, desc=desc, unit=unit, total=total, disable=not enabled, delay=PROGRESS_DELAY_S
    )
