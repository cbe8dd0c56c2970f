"""The vLLM engine's path: aotx in front of vLLM against vLLM's own OpenAI server on the
same model, beside aotx on llama.cpp, A B C A B C.

    .venv/bin/python -m bench.bench_vllm [--clients 1,4,8] [--max-tokens 64]
        [--requests 2] [--rounds 2] [--model FOLDER]
    .venv/bin/python -m bench.bench_vllm --admissions 20 [--bind auto]

Both vLLM servers run from the vLLM Python (``scripts/setup-vllm``; AOTX_VLLM_PYTHON)
with the same engine arguments; the model is ``--model`` (a Hugging Face folder) or the
tests' tiny random Llama, built here.  Each round and N: N concurrent streaming chat
clients (distinct prompts, temperature 0, the end token banned so that every answer is
``--max-tokens`` long, a fresh connection per request) against aotx serving the vLLM
model, then against ``vllm.entrypoints.openai.api_server``, then aotx on its embedded
llama.cpp model.  It prints tok/s, TTFT p50 and inter-token p50 for each, and the ratio
aotx / vLLM's server (the median of the rounds' ratios, each round's in brackets): on a
CPU and a random model the figures say little about speed, the ratio what aotx's path
costs around the same engine.

``--admissions N`` times N native admissions one after the other instead (each waits for
the previous answer to end, 480 tokens): how many took over 100 ms, and the run-queue
wait of this client's thread during the slowest (``/proc/self/schedstat``), with vLLM's
threads bound as ``--bind`` says (``VLLM_CPU_OMP_THREADS_BIND``; the device's default is
``nobind``).  docs/operations.md, "Models served by vLLM", says what it showed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time

import httpx

from bench import common
from bench.bench_serve import pct, run_load

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINE_ARGS = {"enforce_eager": True, "max_model_len": 1024, "dtype": "float32"}
# (both vLLM servers unbound, as the device starts vLLM: engine/vllm.py)
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": ROOT, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def vllm_python() -> str:
    found = os.environ.get("AOTX_VLLM_PYTHON") or subprocess.run(
        [os.path.join(ROOT, "scripts", "setup-vllm")], capture_output=True, text=True,
        check=True).stdout.strip()
    return found


def tiny_model(python: str) -> str:
    folder = tempfile.mkdtemp(prefix="aotx-bench-tiny-", dir="/tmp")
    subprocess.run([python, os.path.join(ROOT, "tests", "vllm", "tiny_model.py"), folder],
                   check=True, capture_output=True)
    return folder


def models_file(folder: str) -> str:
    args = "\n".join(f"{k} = {str(v).lower() if isinstance(v, bool) else repr(v)}"
                     .replace("'", '"') for k, v in ENGINE_ARGS.items())
    return (f'[default]\nslots = 8\ncontext = 1024\n\n[[model]]\nalias = "m"\nengine = "vllm"\n'
            f'path = "{folder}"\n[model.vllm]\n{args}\n')


def start_vllm_server(python: str, folder: str) -> common.Server:
    flags = ["--enforce-eager", "--max-model-len", str(ENGINE_ARGS["max_model_len"]),
             "--dtype", str(ENGINE_ARGS["dtype"]), "--served-model-name", "m",
             "--disable-log-stats"]
    return common.launch([python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                          folder, "--host", "127.0.0.1", *flags], "vllm serve", ENV, 600)


def runq_wait_ns() -> int:
    """Nanoseconds this thread has waited on a run queue (the kernel's schedstat)."""
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
        return int(f.read().split()[1])


def admissions(folder: str, python: str, n: int, bind: str) -> None:
    env = {**ENV, "VLLM_CPU_OMP_THREADS_BIND": bind}
    body = {"model": "m", "messages": [{"role": "user", "content": "Hello world"}],
            "max_tokens": 480, "temperature": 1, "logit_bias": {"1": -100}}
    took: list[tuple[float, float]] = []  # (seconds, of which waiting for a CPU)
    with common.serving(models_file(folder), python=python, env=env) as srv, \
            httpx.Client(base_url=srv.url, headers=srv.headers, timeout=60) as c:
        for _ in range(n):
            t, w = time.monotonic(), runq_wait_ns()
            rid = c.post("/aotx/v1/requests", json=body).raise_for_status().json()["id"]
            took.append((time.monotonic() - t, (runq_wait_ns() - w) / 1e9))
            while c.get(f"/aotx/v1/requests/{rid}").json()["state"] not in ENDED:
                time.sleep(0.05)
    slow = max(took)
    print(f"{n} admissions, VLLM_CPU_OMP_THREADS_BIND={bind}: "
          f"{sum(t > 0.1 for t, _ in took)} over 100 ms; median "
          f"{statistics.median(t for t, _ in took) * 1e3:.1f} ms; slowest "
          f"{slow[0] * 1e3:.0f} ms, of which this client waited {slow[1] * 1e3:.0f} ms "
          "on a run queue")


ENDED = ("completed", "failed", "cancelled")


def show(name: str, rounds: list[dict]) -> str:
    tok = statistics.median(r["tok_s"] for r in rounds)
    ttft = statistics.median(pct(r["ttft"], 50) for r in rounds) * 1e3
    itl = statistics.median(pct(r["itl"], 50) for r in rounds) * 1e3
    return f"{name}: {tok:6.1f} tok/s, TTFT p50 {ttft:6.1f} ms, ITL p50 {itl:5.1f} ms"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--model", default="", help="a Hugging Face model folder (default: tiny)")
    ap.add_argument("--admissions", type=int, default=0, help="time N admissions instead")
    ap.add_argument("--bind", default="nobind", help="VLLM_CPU_OMP_THREADS_BIND, --admissions")
    args = ap.parse_args()
    python = vllm_python()
    folder = args.model or tiny_model(python)
    ban_end: dict[str, object] = {"logit_bias": {"1": -100}} if not args.model else {}
    try:
        if args.admissions:
            admissions(folder, python, args.admissions, args.bind)
            return
        for n in (int(x) for x in args.clients.split(",")):
            got: dict[str, list[dict]] = {"aotx+vllm": [], "vllm serve": [], "aotx+llama": []}
            for _ in range(args.rounds):
                with common.serving(models_file(folder), python=python, env=ENV) as srv:
                    got["aotx+vllm"].append(asyncio.run(run_load(
                        srv.url, srv.headers, "m", n, args.requests, args.max_tokens, 0,
                        ban_end)))
                vllm = start_vllm_server(python, folder)
                try:
                    got["vllm serve"].append(asyncio.run(run_load(
                        vllm.url, {}, "m", n, args.requests, args.max_tokens, 0, ban_end)))
                finally:
                    vllm.stop()
                with common.serving("[default]\nslots = 8\ncontext = 1024\n") as srv:
                    got["aotx+llama"].append(asyncio.run(run_load(
                        srv.url, srv.headers, "smollm2", n, args.requests, args.max_tokens,
                        0)))
            each = [a["tok_s"] / b["tok_s"] for a, b in zip(got["aotx+vllm"],
                                                               got["vllm serve"], strict=True)]
            print(f"{n} client(s):")
            for name, rounds in got.items():
                print("  " + show(name, rounds))
            print(f"  aotx+vllm / vllm serve: {statistics.median(each):.2f} "
                  f"[{'/'.join(f'{x:.2f}' for x in each)}]", flush=True)
    finally:
        if not args.model:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
