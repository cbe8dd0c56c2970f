"""A model fetched by ``aotx pull`` (from a local server posing as the hub) serves."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import openai

from aotx.device.models import default_model_path

from .. import hub
from ..helpers import SMALL_MODELS, make_service


def test_a_pulled_model_serves_as_the_file_it_came_from() -> None:
    with open(default_model_path(), "rb") as f:
        data = f.read()
    svc = make_service()
    try:
        with hub.serving({"HuggingFaceTB/SmolLM2-135M-Instruct-GGUF":
                          {"smollm2-135m-instruct-q4_1.gguf": data}}) as h:
            got = subprocess.run(
                [sys.executable, "-m", "aotx", "--log-level", "WARNING", "pull", "--state-dir",
                 svc.state_dir, "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF:Q4_1"],
                capture_output=True, text=True, timeout=300,
                env={**os.environ, "HF_ENDPOINT": h.url})
        assert got.returncode == 0, got.stderr
        assert got.stdout.split() == [os.path.join(svc.state_dir, "models",
                                                   "smollm2-135m-instruct-q4_1.gguf")]
        with open(os.path.join(svc.state_dir, "models.toml"), "w") as f:
            f.write(SMALL_MODELS + '[[model]]\nalias = "pulled"\n'
                    'path = "models/smollm2-135m-instruct-q4_1.gguf"\nslots = 2\n'
                    'context = 2048\n')
        svc.start()
        client = openai.OpenAI(base_url=svc.url + "/v1", api_key=svc.token, max_retries=0)
        answers = [client.chat.completions.create(
            model=m, messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=12, temperature=0).choices[0].message.content for m in ("smollm2", "pulled")]
        assert answers[0] and answers[0] == answers[1]
    finally:
        svc.stop()
        shutil.rmtree(svc.state_dir, ignore_errors=True)
