"""The Grafana dashboard and docs/operations.md name only metrics migd exports, and the
docs name every one of them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from migd.core.gpus import ManagedGpu, MpsState
from migd.core.scheduler import NodeScheduler
from migd.daemon.metrics.exporter import render
from migd.daemon.metrics.recorder import MetricsRecorder
from migd.daemon.metrics.service import build_registry
from tests.metrics.conftest import finish, gpu, lease
from tests.metrics.test_metrics import Source

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "contrib" / "grafana" / "migd.json"
NAME = re.compile(r"\bmigd_[a-z0-9_]+\b")
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "info": ("_info",),
    "gauge": ("",),
}


def exported() -> tuple[set[str], set[str]]:
    """(family names, series names) of a node with every kind of GPU and instance."""
    v100 = ManagedGpu(1, "GPU-0001", "V100-32GB", "Tesla V100", 32768, MpsState())
    node = NodeScheduler([gpu(0), v100])
    for memory, uuid in ((9000, "GPU-0000"), (2000, "GPU-0001")):
        out = node.submit(lease(memory, gpu_uuids=(uuid,)), 1.0, 1.0)
        finish(node, out.work, 2.0)
    node.gpus[0].used_mib = 100
    for inst in node.gpus[0].instances:
        inst.used_mib = 50
    recorder = MetricsRecorder()
    recorder.xid(0, 79, True)
    recorder.refused.labels(reason="no_capacity")
    body, _ = render(build_registry(Source(node), recorder))
    families, series = set(), set()
    for family in text_string_to_metric_families(body.decode()):
        if family.name.endswith("_created"):  # the text format's counter creation times
            continue
        families.add(family.name)
        series |= {family.name + suffix for suffix in SUFFIXES[family.type]}
    return families, series


def exprs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [v for k, v in node.items() if k in ("expr", "definition") and isinstance(v, str)]
        return found + [e for v in node.values() for e in exprs(v)]
    if isinstance(node, list):
        return [e for v in node for e in exprs(v)]
    return []


def test_the_dashboard_is_valid_json_whose_queries_name_existing_metrics() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = exprs(dashboard)
    assert len(queries) >= 20
    _, series = exported()
    used = {name for q in queries for name in NAME.findall(q)}
    assert used, "the dashboard queries no migd metric"
    assert used <= series, f"not exported: {sorted(used - series)}"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_the_dashboard_shows_every_family_but_the_bookkeeping_ones() -> None:
    families, _ = exported()

    def family_of(name: str) -> str:
        for suffix in ("", "_bucket", "_sum", "_count", "_total"):
            if name.endswith(suffix) and name.removesuffix(suffix) in families:
                return name.removesuffix(suffix)
        return name

    used = {
        family_of(name)
        for q in exprs(json.loads(DASHBOARD.read_text()))
        for name in NAME.findall(q)
    }
    bookkeeping = {"migd_start_time_seconds", "migd_mig_instance_busy", "migd_gpu_healthy"}
    missing = families - used - bookkeeping
    assert not missing, f"no panel shows {sorted(missing)}"


def test_docs_operations_documents_every_metric_and_no_other() -> None:
    text = (ROOT / "docs" / "operations.md").read_text()
    monitoring = text[text.index("## Monitoring") :]
    monitoring = monitoring[: monitoring.find("\n## ", 1) if "\n## " in monitoring[1:] else None]
    families, series = exported()
    named = set(NAME.findall(monitoring))
    missing = {f for f in families if f not in named and f"{f}_total" not in named}
    assert not missing, f"undocumented: {sorted(missing)}"
    assert named <= series | families, (
        f"documented but not exported: {sorted(named - series - families)}"
    )
