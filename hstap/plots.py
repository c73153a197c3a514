"""Matplotlib set up once for files, not screens (the Agg backend: no display on servers), and one way to save."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

__all__ = ["plt", "save_figure"]


def save_figure(fig, path: Path) -> Path:
    """Lay out, write as a 100-dpi PNG, and free the figure (long runs plot every epoch)."""
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
