"""The coverage page generator keeps the hand-written upstream comparison when it rewrites the page."""

from __future__ import annotations

from tests.conformance.op_coverage import kept_sections, render


def test_regeneration_keeps_the_dtensor_comparison() -> None:
    page = "\n".join(
        [
            "# Op coverage (generated)",
            "## Summary",
            "| old |",
            "## Comparison with upstream DTensor",
            "",
            "| status | dtorch | DTensor |",
            "## Rules by family",
            "| view | 27 |",
        ]
    )
    kept = kept_sections(page)
    assert kept == "## Comparison with upstream DTensor\n\n| status | dtorch | DTensor |"
    assert kept_sections("# no such section\n## Summary\n") == ""
    new = render({}, 1, 0.0, kept)
    assert new.index("## Summary") < new.index(kept) < new.index("## Rules by family")
    assert kept_sections(new) == kept  # stable over repeated regenerations
