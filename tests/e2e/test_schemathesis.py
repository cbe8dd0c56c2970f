"""The HTTP API under schemathesis, against the project's own OpenAPI document.

Generated requests (fuzzing and coverage phases) must never get a 5xx, and every
status code and content type must be one the document declares.
"""

from __future__ import annotations

import os
import subprocess
import sys

from ..helpers import Service


def test_api_against_its_openapi_document(service: Service) -> None:
    st = os.path.join(os.path.dirname(sys.executable), "st")
    r = subprocess.run(
        [st, "run", service.url + "/openapi.json", "-H", f"Authorization: Bearer {service.token}",
         "--max-examples", "10", "--request-timeout", "60", "--phases", "fuzzing,coverage",
         "--checks", "not_a_server_error,status_code_conformance,content_type_conformance,"
         "response_schema_conformance",
         "--seed", "1"],
        capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert " passed" in out and "failed" not in out.split("SUMMARY")[-1]
