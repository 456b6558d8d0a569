"""Is the selected plugin certified? Its certification report, checked against the code installed here.

A report (``vllm-port certify PLUGIN --report DIR`` writes ``DIR/report.json``) certifies the
plugin only when it verifies (its digest holds: nobody edited it), its verdict is ``certified``,
it names the selected plugin at the installed version, and the sha256 it records over the
sources of the packages that ran (core, the suite, the plugin) equals the same sha256 computed
over the packages installed here. Any other change to those sources needs a new certification.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from vllm_port.discovery import PluginRecord

from .errors import BridgeError

__all__ = ["CERTIFICATE_ENV", "certificate_problems", "check_certificate"]

CERTIFICATE_ENV = "VLLM_PORT_CERTIFICATE"


def certificate_problems(report: Any, record: PluginRecord) -> list[str]:
    """Why ``report`` does not certify ``record``'s plugin as installed here; empty when it does."""
    from vllm_port_conformance.certify import source_digest, verify

    problems = verify(report)
    if not isinstance(report, dict):
        return problems
    if report.get("verdict") != "certified":
        problems.append(f"its verdict is {report.get('verdict')!r} ({report.get('reason', 'no reason given')})")
    plugin = report.get("plugin") if isinstance(report.get("plugin"), dict) else {}
    if plugin.get("name") != record.name:
        problems.append(f"it certifies plugin {plugin.get('name')!r}, not the selected plugin {record.name!r}")
    if plugin.get("version") != record.version:
        problems.append(f"it certifies version {plugin.get('version')!r}, but {record.version!r} is installed")
    source = report.get("source") if isinstance(report.get("source"), dict) else {}
    packages = source.get("packages")
    if isinstance(packages, list) and packages:
        here = source_digest(packages)
        if here["sha256"] != source.get("sha256"):
            problems.append(
                f"the sources of {', '.join(packages)} installed here (sha256 {here['sha256'][:12]}..., "
                f"{here['files']} files) are not those it certified (sha256 {str(source.get('sha256'))[:12]}..., "
                f"{source.get('files')} files)"
            )
    else:
        problems.append("it lists no source packages, so it cannot be tied to the code installed here")
    return problems


def check_certificate(record: PluginRecord, path: str | None = None) -> dict[str, Any]:
    """The report at ``path`` (default ``VLLM_PORT_CERTIFICATE``) when it certifies ``record``'s plugin.

    :raises BridgeError: naming the plugin, the report and each problem, with the command that certifies.
    """
    path = path or os.environ.get(CERTIFICATE_ENV) or None
    fix = (
        f"certify it here: vllm-port certify {record.name} --report DIR, then start vLLM with "
        f"{CERTIFICATE_ENV}=DIR/report.json"
    )
    if path is None:
        raise BridgeError(
            f"vllm-port bridge: plugin {record.name!r} ({record.distribution} {record.version}) has no certificate: "
            f"{CERTIFICATE_ENV} is not set. The bridge runs only certified kernels inside vLLM; {fix}"
        )
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise BridgeError(
            f"vllm-port bridge: {CERTIFICATE_ENV}={path!r} cannot be read as JSON ({exc}); {fix}"
        ) from exc
    problems = certificate_problems(report, record)
    if problems:
        raise BridgeError(
            f"vllm-port bridge: plugin {record.name!r} ({record.distribution} {record.version}) is not certified by "
            f"{path}: {'; '.join(problems)}. {fix}"
        )
    return report
