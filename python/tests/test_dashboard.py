"""The Grafana dashboard survives a round trip through grafana-foundation-sdk (issue 34).

Tools built on the SDK read a dashboard into its model, which fills in the dashboard schema's
defaults, and write it back. The schema's default for ``legend.showLegend`` is false: a
dashboard that leaves it out comes back with every legend hidden. Here dashboards/diffmon.json
is loaded into the SDK's ``Dashboard`` model (``Dashboard.from_json``, with the SDK's panel and
query plugins registered, as its own decoding does) and serialized again (``JSONEncoder``);
every timeseries panel still shows its legend, and every panel keeps its overrides, queries,
legend formats and repetition.
"""

import copy
import json
from pathlib import Path

# Pinned in python/requirements.txt (make setup installs it).
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models.dashboard import Dashboard

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "dashboards" / "diffmon.json"


def round_trip(data: dict) -> dict:
    """``data`` read into the SDK's model and written back as JSON."""
    register_default_plugins()
    model = Dashboard.from_json(copy.deepcopy(data))
    return json.loads(json.dumps(model, cls=JSONEncoder))


def test_legends_and_overrides_survive_the_sdk_round_trip():
    original = json.loads(DASHBOARD.read_text())
    back = round_trip(original)
    assert [p["id"] for p in back["panels"]] == [p["id"] for p in original["panels"]]
    timeseries = 0
    for before, after in zip(original["panels"], back["panels"]):
        title = before["title"]
        if before["type"] == "timeseries":
            timeseries += 1
            legend = after["options"]["legend"]
            assert legend["showLegend"] is True, title
            assert legend["displayMode"] == "list", title
        assert after["fieldConfig"]["overrides"] == before["fieldConfig"].get("overrides", []), title
        assert after["fieldConfig"]["defaults"].get("unit") == before["fieldConfig"]["defaults"].get("unit"), title
        assert after.get("repeat") == before.get("repeat"), title
        targets = [(t["refId"], t["expr"], t["legendFormat"]) for t in after["targets"]]
        assert targets == [(t["refId"], t["expr"], t["legendFormat"]) for t in before["targets"]], title
    assert timeseries >= 10
    # The band of the ICR panel: its upper bound still fills down to the lower.
    icr = next(p for p in back["panels"] if p.get("repeat") == "run")
    fills = [prop["value"] for o in icr["fieldConfig"]["overrides"] for prop in o["properties"]
             if prop["id"] == "custom.fillBelowTo"]
    assert fills == ["ICR - s.e."]


def test_the_sdk_hides_a_legend_that_does_not_say_it_is_shown():
    """Why the dashboard says ``showLegend: true``: without it the SDK writes false."""
    data = json.loads(DASHBOARD.read_text())
    panel = next(p for p in data["panels"] if p["type"] == "timeseries")
    del panel["options"]["legend"]["showLegend"]
    back = round_trip(data)
    after = next(p for p in back["panels"] if p["id"] == panel["id"])
    assert after["options"]["legend"]["showLegend"] is False
