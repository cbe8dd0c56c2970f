"""The soak (bench/soak.py) in a short version: about a minute of mixed clients
(longer where the machine is slow: it runs until each kind was served five times).

Every byte received (windows, SSE with drops and resumes, standard streams) is
checked against the final windows; a hostile principal floods, drops streams, fills
its media share, floods embeddings and sends costly and unmatchable schemas beside the
workers, and nothing the workers do may fail; once
results are reclaimed the device's service allocation is back where it started.
"""

from __future__ import annotations

import os

from bench import soak


def test_short_soak_loses_nothing() -> None:
    report, m = soak.run(seconds=float(os.environ.get("AOTX_SOAK_SECONDS", "45")), workers=4,
                         seed=7, retention=3, each=5)
    # it ran until every kind of client was served five times (longer on a slow machine)
    assert all(report.served[k] >= 5 for k in soak.KINDS), report.served
    assert report.mismatches == []
    assert report.errors == {}, report.errors  # the hostile principal took nothing from them
    assert report.hostile["submit 202"] > 0 and report.hostile["submit 429"] > 0, report.hostile
    assert report.hostile["events 200"] > 0 and report.hostile["media 201"] > 0, report.hostile
    # issue 39: its embedding flood and its schemas ran too (the unmatchable one refused)
    assert report.hostile["embed 200"] > 0 and report.hostile["schema 400"] > 0, report.hostile
    assert m["alloc1"] == m["alloc0"], m
