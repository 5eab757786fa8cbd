"""Schemathesis against the real server's /openapi.json: generated requests, valid and not, on every route.

The checks: no 5xx; every status, content type, header and body as the schema declares (SSE events too);
a request that violates the schema is refused; an undeclared method gets 405 with `Allow`. Left out:
"schema-valid request accepted", since some valid shapes are refused on purpose with a 4xx that says why
(token ids past the vocabulary, more choices than slots, a feature kvserve does not have).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx

from tests.server_harness import serve

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
          "response_headers_conformance,negative_data_rejection,unsupported_method,missing_required_header")


def test_generated_requests_find_no_server_error_and_no_schema_violation(model_dir, tmp_path):
    report = tmp_path / "schemathesis.json"
    cli = Path(sys.executable).with_name("schemathesis")
    # A short context keeps each generated generation short: longer asks are 4xx, which the schema declares.
    with serve(model_dir("long"), max_seq_len=96) as server:
        result = subprocess.run([str(cli), "run", f"{server.url}/openapi.json", "--checks", CHECKS,
                                 "--max-examples", "25", "--workers", "1", "--seed", "1", "--report", "json",
                                 "--report-json-path", str(report)], capture_output=True, text=True, timeout=1200)
        metrics = httpx.get(f"{server.url}/metrics").text
        health = httpx.get(f"{server.url}/health").status_code
    run = json.loads(report.read_text())
    assert result.returncode == 0 and run["failures"] == [] and run["errors"] == [], result.stdout[-4000:]
    assert run["operations"]["tested"] == run["operations"]["total"] >= 10
    assert run["test_cases"]["generated"] >= 500
    assert 'kvserve_request_failures_total{reason="internal"}' not in metrics and health == 200
